"""Checks every test in tests/ gets: no process it started outlives it (tests/support/leaks.py).

Registered as a plugin rather than as this conftest's own hooks: a session-scoped fixture's
setup is announced to the hooks of the root directory, which a conftest here does not see.

With pytest-xdist (`scripts/test` runs the suite on two workers, `--dist loadgroup`) each test
goes to a worker with its whole group: a folder whose modules share session-scoped gateways or
engines is one group, so those start once; every other module is a group of its own, so its
module-scoped fixtures start once too.
"""

from pathlib import Path

import pytest

from tests.support import leaks

_TESTS = Path(__file__).resolve().parent

#: Folders whose modules share session-scoped fixtures (a running gateway, built engines and
#: generated models, a chart render, the Go-built tools), or that each start vLLM (~4 GB):
#: one worker runs each.
SHARED = ("gateway", "cold", "engines", "chart", "tools")


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin(leaks.__name__):
        config.pluginmanager.register(leaks, leaks.__name__)


def group_of(path: Path) -> str:
    """The worker group of a test module: its shared folder, else the module itself."""
    relative = path.resolve().relative_to(_TESTS)
    if len(relative.parts) > 1 and relative.parts[0] in SHARED:
        return relative.parts[0]
    return relative.as_posix()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.has_plugin("xdist"):
        return
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group_of(item.path)))
