"""A tool the suite needs is missing: skip on a developer's machine, fail where it must be there.

`scripts/test` (the README's test command, and so CI) sets `WAKEGATE_REQUIRE_TOOLS=1` after
installing and building what the suite drives: Go-built tools, engines, Prometheus. A test that
then finds one missing fails with the reason instead of skipping, so a broken install cannot pass
as a green run with fewer tests. Skips that are about this machine rather than the install (no
GPU, opt-in scale runs) do not go through here.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

ENV = "WAKEGATE_REQUIRE_TOOLS"


def required() -> bool:
    """Whether missing tools fail the run (`WAKEGATE_REQUIRE_TOOLS=1`)."""
    return os.environ.get(ENV, "") == "1"


def missing(reason: str) -> NoReturn:
    """Skip the test for `reason`, or fail it when tools are required."""
    if required():
        pytest.fail(f"{reason} ({ENV}=1: this run installs it, so it must be here)", pytrace=False)
    pytest.skip(reason)
