"""Sustained demand above targetInFlight x replicas adds replicas up to max, through the real gateway."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from tests.support.up import UpProcess, model_doc


@pytest.mark.parametrize("native", [False, True], ids=["decided", "native"])
async def test_sustained_demand_adds_replicas_up_to_max(tmp_path: Path, native: bool) -> None:
    """On the native path extproc never sees these streams: Envoy's counters are the demand."""
    routing = "  routing: {strategy: round-robin, path: native}\n" if native else ""
    up = UpProcess(
        tmp_path,
        model_doc(
            "busy",
            extra=f"""  args: [--tokens-per-second, "20"]
  scaling: {{min: 1, max: 3, targetInFlight: 1, idleTimeout: 120}}
{routing}""",
        ),
    )
    try:
        up.wait_ready({"busy": 1})
        if native:
            deadline = time.monotonic() + 10
            while up.status()["models"][0]["routingPath"] != "native":
                assert time.monotonic() < deadline, up.status()["models"][0]
                await asyncio.sleep(0.1)
        peak = 0

        async def stream(session: aiohttp.ClientSession) -> None:
            body = {"model": "busy", "messages": [{"role": "user", "content": "go"}], "max_tokens": 120, "stream": True}
            async with session.post(f"{up.base_url}/chat/completions", json=body) as response:
                assert response.status == 200
                await response.read()

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, next(m for m in up.status()["models"] if m["key"] == "busy")["ready"])
                await asyncio.sleep(0.2)

        async with aiohttp.ClientSession() as session:
            watcher = asyncio.create_task(watch())
            started = time.monotonic()
            await asyncio.gather(*(stream(session) for _ in range(4)))  # 4 x 6 s streams, demand 4 > 1 x 1
            watcher.cancel()
        assert peak == 3, f"expected scale-out to max=3, saw at most {peak} ready replicas"
        assert time.monotonic() - started < 30
        assert "scale model=busy from=1 to=3" in up.log()
    finally:
        assert up.stop() == 0
