"""No process a test starts outlives it: a pytest plugin (loaded by tests/conftest.py).

Before each test the pytest process's descendants are noted; after its teardown, any descendant
that is new, still running and not started by a fixture of a wider scope (session, package,
module, class: those keep their processes across tests and stop them in their own teardown) is
given a short grace to exit, then killed, and the test errors at teardown naming each one. A
wider fixture's processes are checked the same way once that fixture has been torn down.

Descendants are read from /proc/PID/task/TID/children (Linux), which lists only a process's own
children, so a check costs a few small reads rather than a scan of every process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Collection, Iterator
from pathlib import Path

import pytest

#: Seconds a leftover process is given to finish exiting before it is killed.
GRACE_SECONDS = 1.0

#: pid -> the wider-scoped fixture whose setup started it (its descendants count as its own).
_kept: dict[int, pytest.FixtureDef[object]] = {}
#: descendants of pytest when the current test started
_before: set[int] = set()


def descendants(root: int | None = None) -> dict[int, int]:
    """pid -> parent pid of every process below `root` (default: this process)."""
    out: dict[int, int] = {}
    stack = [os.getpid() if root is None else root]
    while stack:
        parent = stack.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                text = Path(f"/proc/{parent}/task/{task}/children").read_text()
            except OSError:
                continue
            for word in text.split():
                child = int(word)
                if child not in out:
                    out[child] = parent
                    stack.append(child)
    return out


def running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie (exited, waiting to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def describe(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"pid {pid}"
    return f"pid {pid}: " + " ".join(a.decode(errors="replace") for a in argv if a)[:200]


def _under(pid: int, parents: dict[int, int], roots: Collection[int]) -> bool:
    """Whether `pid` is one of `roots` or below one."""
    while pid in parents:
        if pid in roots:
            return True
        pid = parents[pid]
    return False


def leftovers(before: set[int]) -> list[int]:
    """Running processes that should be gone now: new since `before` and not a live wider
    fixture's, or a torn-down wider fixture's (and theirs)."""
    parents = descendants()
    stale: set[int] = set()
    for pid, fixturedef in list(_kept.items()):
        if pid not in parents or fixturedef.cached_result is None:
            del _kept[pid]  # exited, or its fixture is torn down and it should have gone with it
            stale.add(pid)
    should_be_gone = [pid for pid in parents if pid not in before or _under(pid, parents, stale)]
    return [pid for pid in should_be_gone if not _under(pid, parents, _kept.keys()) and running(pid)]


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[object], request: pytest.FixtureRequest) -> Iterator[object]:
    if fixturedef.scope == "function":
        return (yield)
    before = set(descendants())
    try:
        return (yield)
    finally:
        for pid in set(descendants()) - before:
            _kept[pid] = fixturedef


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    global _before
    _before = set(descendants())
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    try:
        return (yield)
    finally:
        _check(item)


def _check(item: pytest.Item) -> None:
    """Kill what the test left running, and fail its teardown naming each process."""
    left = leftovers(_before)
    deadline = time.monotonic() + GRACE_SECONDS
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [pid for pid in left if running(pid)]
    if not left:
        return
    names = [describe(pid) for pid in left]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"{item.nodeid} left {len(left)} process(es) running (now killed):\n  " + "\n  ".join(names))
