"""The Go-built tools (e2e/tools) the tests in this folder drive: built once, then reused."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tools import built


@pytest.fixture(scope="session")
def registry_bin() -> Path:
    return built("registry")


@pytest.fixture(scope="session")
def oras_bin() -> Path:
    return built("oras")


@pytest.fixture(scope="session")
def h2spec_bin() -> Path:
    return built("h2spec")
