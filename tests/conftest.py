"""Checks every test in tests/ gets: no process it started outlives it (tests/support/leaks.py).

Registered as a plugin rather than as this conftest's own hooks: a session-scoped fixture's
setup is announced to the hooks of the root directory, which a conftest here does not see."""

import pytest

from tests.support import leaks


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin(leaks.__name__):
        config.pluginmanager.register(leaks, leaks.__name__)
