"""A missing tool skips a test on a developer's machine and fails it under `scripts/test` (CI)."""

from __future__ import annotations

import subprocess

import pytest

from tests.support import REPO_ROOT
from tests.support.required import ENV, missing


def test_a_missing_tool_skips_unless_tools_are_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="frobnicator is not built"):
        missing("frobnicator is not built")
    monkeypatch.setenv(ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=rf"frobnicator is not built \({ENV}=1"):
        missing("frobnicator is not built")


def test_scripts_test_requires_the_tools_it_installs() -> None:
    """The README's test command turns the switch on (unless told otherwise) and stops at once,
    with the way out, when a toolchain it builds with is missing."""
    script = (REPO_ROOT / "scripts" / "test").read_text()
    assert f'export {ENV}="${{{ENV}:-1}}"' in script
    out = subprocess.run(
        ["/bin/bash", "-c", script[script.index(f"export {ENV}") : script.index("# Go-built tools")]],
        env={"PATH": "/nonexistent"},
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1 and f"{ENV}=0 scripts/test" in out.stderr
