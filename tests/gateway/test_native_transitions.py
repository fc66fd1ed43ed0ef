"""Native-path transitions under an open-loop load, through the real gateway (`wakegate up`).

The load is open-loop: requests start at a fixed rate whether or not earlier ones have been
answered, as real clients' do, so a stall shows as requests piling up, not as a lower rate.
Every request started is accounted for: answered with a status, or counted as lost (status 0:
reset, refused, timed out). Each test asserts zero non-200 and zero lost, and that the model
went through the transition while the load was on:

* a replica of a native model draining (scale-in 2 -> 1) under load: the model stays native,
  the leaving replica's requests finish, nobody meets the leaving replica afterwards;
* a native model going cold (idle release, native -> decided) while a neighbour takes 100
  req/s, released idleTimeout after its last request, then woken by 200 req/s of its own:
  held while it starts, native again once warm.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from tests.support.http import EXTPROC_STREAMS, envoy_stat
from tests.support.up import UpProcess, model_doc
from wakegate.control.admin import free_port
from wakegate.extproc.cold import LEASE_GRACE_SECONDS

IDLE_SECONDS = 3


class OpenLoad:
    """Requests to one model at `rate` per second (changeable while it runs) until stopped."""

    def __init__(self, session: aiohttp.ClientSession, url: str, model: str, rate: float) -> None:
        self.session = session
        self.url = url + "/v1/chat/completions"
        self.model = model
        self.rate = rate
        self.sent = 0
        self.statuses: dict[int, int] = {}
        self.last_started = 0.0
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> OpenLoad:
        self._task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> dict[int, int]:
        """Stop starting requests, wait for every started one to end: their statuses."""
        self._stop.set()
        assert self._task is not None
        await self._task
        return self.statuses

    async def _one(self) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        try:
            async with self.session.post(self.url, json=body) as response:
                await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError):
            status = 0
        self.statuses[status] = self.statuses.get(status, 0) + 1

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        running: set[asyncio.Task[None]] = set()
        next_at = loop.time()
        while not self._stop.is_set():
            now = loop.time()
            if now < next_at:
                await asyncio.sleep(next_at - now)
                continue
            next_at += 1 / self.rate
            self.sent += 1
            self.last_started = time.monotonic()
            task = asyncio.create_task(self._one())
            running.add(task)
            task.add_done_callback(running.discard)
        await asyncio.gather(*running)


def _session() -> aiohttp.ClientSession:
    # No client-side connection cap: a held request must not delay the next one's start.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60)
    )


def _model(up: UpProcess, key: str) -> dict[str, Any]:
    return next(m for m in up.status()["models"] if m["key"] == key)


async def _until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(check):
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.1)


async def test_a_replica_drains_under_load_while_the_model_stays_native(tmp_path: Path) -> None:
    """200 req/s scale `drn` out to 2 replicas; at 20 req/s one replica is removed after
    scaleInWindow while the load goes on: no 5xx, none lost, native throughout."""
    envoy_admin = f"127.0.0.1:{free_port()}"
    up = UpProcess(
        tmp_path,
        model_doc(
            "drn",
            extra="""  args: [--tokens-per-second, "20"]
  routing: {strategy: round-robin, path: native}
  scaling: {min: 1, max: 2, targetInFlight: 4, scaleInWindow: 2, idleTimeout: 120}
""",
        ),
        "--envoy-admin-listen",
        envoy_admin,
    )
    try:
        up.wait_ready({"drn": 1}, timeout=60)
        await _until(lambda: _model(up, "drn")["routingPath"] == "native", 10, "drn never went native")
        streams = await asyncio.to_thread(envoy_stat, envoy_admin, EXTPROC_STREAMS)
        paths: set[str] = set()
        async with _session() as session:
            load = OpenLoad(session, up.url, "drn", 200).start()

            def replicas(n: int) -> Callable[[], bool]:
                def check() -> bool:
                    model = _model(up, "drn")
                    paths.add(model["routingPath"])
                    return bool(model["ready"] == n)

                return check

            # ~30 requests in flight (3 tokens at 20/s each) need 8 replicas of 4: out to max.
            await _until(replicas(2), 20, "no scale-out to 2 under 200 req/s")
            await asyncio.sleep(1)
            # ~3 in flight need one replica: after scaleInWindow one of the two drains.
            load.rate = 20
            await _until(replicas(1), 20, "no scale-in to 1 at 20 req/s")
            await asyncio.sleep(1.5)  # the load goes on against the one left
            statuses = await load.stop()
        print(f"drn: {load.sent} requests, statuses {statuses}, paths {paths}")
        assert statuses == {200: load.sent}, statuses
        assert paths == {"native"}, paths
        streams = await asyncio.to_thread(envoy_stat, envoy_admin, EXTPROC_STREAMS) - streams
        assert streams < load.sent // 20, f"{streams} of {load.sent} warm requests went through extproc"
        log = up.log()
        assert "scale model=drn from=1 to=2" in log and "scale model=drn from=2 to=1" in log, log[-3000:]
    finally:
        assert up.stop() == 0, up.log()[-3000:]


async def test_a_native_model_goes_cold_and_wakes_at_200_rps_beside_a_busy_neighbour(tmp_path: Path) -> None:
    """`nap` (scale to zero) is released idleTimeout after its last request while `busy` takes
    100 req/s through the same Envoy, then 200 req/s wake it: held while it starts, native once
    warm. Neither model answers anything but 200 or loses a request."""
    envoy_admin = f"127.0.0.1:{free_port()}"
    fleet = model_doc(
        "busy", extra="  routing: {strategy: round-robin, path: native}\n  scaling: {min: 1, max: 1}\n"
    ) + model_doc(
        "nap",
        extra=f"""  args: [--startup-seconds, "1"]
  routing: {{strategy: round-robin, path: native}}
  scaling: {{min: 0, max: 1, idleTimeout: {IDLE_SECONDS}}}
  endpoint: {{maxQueue: 1000}}
""",
    )
    up = UpProcess(tmp_path, fleet, "--envoy-admin-listen", envoy_admin)
    try:
        up.wait_ready({"busy": 1, "nap": 0}, timeout=60)
        await _until(lambda: _model(up, "busy")["routingPath"] == "native", 10, "busy never went native")
        async with _session() as session:
            neighbour = OpenLoad(session, up.url, "busy", 100).start()
            # Wake nap with 200 req/s: the first ones are held while it starts.
            waking = OpenLoad(session, up.url, "nap", 200).start()
            await _until(lambda: _model(up, "nap")["ready"] == 1, 30, "nap did not wake")
            await _until(lambda: _model(up, "nap")["routingPath"] == "native", 10, "nap never went native")
            # The wake's lease keeps the model busy for its grace after ready; load past it, so
            # the idle timer starts at the last request.
            await asyncio.sleep(LEASE_GRACE_SECONDS + 0.5)
            first = await waking.stop()
            last = waking.last_started
            # Idle: released idleTimeout after its last request, while busy's load goes on.
            await _until(lambda: _model(up, "nap")["ready"] == 0, IDLE_SECONDS + 10, "nap not released")
            released = time.monotonic() - last
            cold = await asyncio.to_thread(_model, up, "nap")
            # Cold again: 200 req/s wake it a second time.
            again = OpenLoad(session, up.url, "nap", 200).start()
            await _until(lambda: _model(up, "nap")["routingPath"] == "native", 30, "nap did not wake again")
            await asyncio.sleep(0.5)
            second = await again.stop()
            busy = await neighbour.stop()
        print(
            f"nap: {waking.sent} + {again.sent} requests, released {released:.2f}s after the last; "
            f"busy: {neighbour.sent} requests"
        )
        assert first == {200: waking.sent}, first
        assert second == {200: again.sent}, second
        assert busy == {200: neighbour.sent}, busy
        assert cold["routingPath"] == "decided" and cold["routingPathReason"] == "no ready endpoint", cold
        # idleTimeout holds to within a second (plus one status poll).
        assert IDLE_SECONDS - 0.5 <= released <= IDLE_SECONDS + 1.2, released
    finally:
        assert up.stop() == 0, up.log()[-3000:]
