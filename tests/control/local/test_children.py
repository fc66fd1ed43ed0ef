"""Supervised children (control/local/children.py) on their own: the pauses between restarts of a
child that keeps exiting, and the crash loop that ends them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from wakegate.control.local import children
from wakegate.control.local.children import CrashLoop, Supervised


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
