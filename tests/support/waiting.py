"""Waiting for what a test expects to happen, the one way every test and e2e module polls."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(check: Callable[[], T], timeout: float, what: str, every: float = 0.1) -> T:
    """Call `check` every `every` seconds until it returns something truthy, and return that;
    after `timeout` seconds fail naming `what` and the last value seen."""
    deadline = time.monotonic() + timeout
    last = check()
    while not last:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
        time.sleep(every)
        last = check()
    return last
