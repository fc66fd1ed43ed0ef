"""Waiting for what a test expects to happen, the one way every test and e2e module polls."""

from __future__ import annotations

import asyncio
import socket
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


async def waited(check: Callable[[], T], timeout: float, what: str, every: float = 0.02) -> T:
    """`wait_for` for a test running on an event loop: the loop runs while it waits."""
    deadline = time.monotonic() + timeout
    last = check()
    while not last:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
        await asyncio.sleep(every)
        last = check()
    return last


def accepting(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts connections on HOST:PORT now."""
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return False
    return True
