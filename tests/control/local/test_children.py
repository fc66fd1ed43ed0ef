"""Supervised children (control/local/children.py) on their own: the pauses between restarts of a
child that keeps exiting, and the crash loop that ends them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.support.up import pids_alive
from wakegate.control.local import children
from wakegate.control.local.children import Child, CrashLoop, Supervised


class ExitsAtOnce:
    """Stands in for a Child whose process exits as soon as it starts."""

    def __init__(self, log_path: Path) -> None:
        self.name = "flaky"
        self.pid = 4242
        self.log_path = log_path
        self.starts = 0

    async def start(self) -> None:
        self.starts += 1

    async def wait(self) -> int:
        return 1

    def tail(self) -> str:
        return "the last words"


async def test_restarts_back_off_doubling_from_the_second_up_to_the_maximum_then_give_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pauses: list[float] = []

    async def no_wait(seconds: float) -> None:
        pauses.append(seconds)

    monkeypatch.setattr(children.asyncio, "sleep", no_wait)
    child = ExitsAtOnce(tmp_path / "flaky.log")
    supervised = Supervised(child, budget=8, window=60.0, backoff_max=0.5)  # type: ignore[arg-type]
    await supervised.start()
    with pytest.raises(CrashLoop, match="flaky exited 9 times within 60s") as loop:
        await asyncio.wait_for(supervised.run(), 10)
    assert pauses == pytest.approx([0.0, 0.1, 0.2, 0.4, 0.5, 0.5, 0.5, 0.5])
    assert supervised.restarts == 8 and child.starts == 9
    assert "the last words" in str(loop.value)


async def test_a_stop_cut_short_still_takes_the_whole_group_with_it(tmp_path: Path) -> None:
    """`up` can exit while a scale-down is still stopping a replica. The child must not outlive
    that: a process that only dies with its parent leaves its own children behind (Ollama's
    runner did, orphaned, holding its model)."""
    pidfile = tmp_path / "grandchild"
    script = f'trap "" TERM; sleep 60 & echo $! > {pidfile}; wait'  # ignores SIGTERM, and so does its child
    child = Child("stubborn", ["sh", "-c", script], tmp_path / "stubborn.log")
    await child.start()
    for _ in range(200):
        if pidfile.exists() and pidfile.read_text().strip():
            break
        await asyncio.sleep(0.02)
    grandchild = int(pidfile.read_text())
    assert child.pid is not None and pids_alive([child.pid, grandchild]) == [child.pid, grandchild]
    stopping = asyncio.create_task(child.stop(grace=60))
    await asyncio.sleep(0.3)
    assert not stopping.done(), "SIGTERM is ignored: the stop waits out its grace"
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping
    for _ in range(250):
        if not pids_alive([child.pid, grandchild]):
            break
        await asyncio.sleep(0.02)
    assert pids_alive([child.pid, grandchild]) == []
