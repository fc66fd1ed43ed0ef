"""The Go-built tools (e2e/tools) as test fixtures: built once, then reused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from e2e.tools import TOOLS, BuildError, ensure
from tests.support.required import missing


def built(name: str) -> Path:
    """The tool's binary, built if its pins changed; skips only where it cannot be built (no Go)."""
    if not TOOLS[name].is_current() and shutil.which("go") is None:
        missing(f"{name} is not built and `go` is missing (python -m e2e.tools {name} builds it)")
    try:
        return ensure(name)
    except BuildError as exc:
        pytest.fail(f"building {name} failed: {exc}")


@pytest.fixture(scope="session")
def registry_bin() -> Path:
    return built("registry")


@pytest.fixture(scope="session")
def oras_bin() -> Path:
    return built("oras")
