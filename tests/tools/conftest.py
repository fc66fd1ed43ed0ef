"""The Go-built tools (e2e/tools) the tests in this folder drive: built once, then reused."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tools import built, oras_bin, registry_bin

__all__ = ["h2spec_bin", "oras_bin", "registry_bin"]


@pytest.fixture(scope="session")
def h2spec_bin() -> Path:
    return built("h2spec")
