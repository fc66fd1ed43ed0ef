"""Demand reports from this gateway to the scaler: on every cold-path transition and every 2 s.

Each report carries this gateway's id, a process-unique instance id and a
strictly increasing sequence, so the receiver can drop stale or replayed
reports and tell a restarted gateway from a live one. Shutting down sends a
withdrawal so the scaler forgets this gateway's share at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable

import grpc

from wakegate.internal_token import TokenSource
from wakegate.v1 import demand_pb2, demand_pb2_grpc

log = logging.getLogger("wakegate.extproc.demand")

#: (queued, leases, failures_seen) per model from the cold queues; in-flight per model from the gateway.
ColdSnapshot = Callable[[], dict[str, tuple[int, int, int]]]
InFlightSnapshot = Callable[[], dict[str, int]]
#: model -> its on-demand LoRA adapters as this gateway holds for and uses them (extproc/adapters.py).
AdapterSnapshot = Callable[[], dict[str, list[demand_pb2.AdapterDemand]]]

#: Longest a lazy change (in-flight going to or from zero) waits to be reported, seconds.
LAZY_INTERVAL = 0.25


class DemandReporter:
    def __init__(
        self,
        target: str,
        gateway_id: str,
        cold: ColdSnapshot,
        in_flight: InFlightSnapshot,
        *,
        token: TokenSource | None = None,
        interval: float = 2.0,
        on_delivered: Callable[[], None] = lambda: None,
        adapters: AdapterSnapshot = dict,
    ) -> None:
        self._target = target
        self._gateway_id = gateway_id
        self._instance = uuid.uuid4().hex
        self._sequence = 0
        self._cold = cold
        self._in_flight = in_flight
        self._adapters = adapters
        self._token = token
        self._interval = interval
        self._on_delivered = on_delivered
        self._wake = asyncio.Event()
        self._urgent = False
        self._lazy = False
        self._last_sent = 0.0
        self.sent = 0
        self.failed = 0

    def changed(self) -> None:
        """Something on the cold path moved: report on the next loop turn."""
        self._urgent = True
        self._wake.set()

    def changed_lazily(self) -> None:
        """Load moved (a model went idle or busy): report within `LAZY_INTERVAL`, coalesced.

        In-flight transitions happen twice per request at low concurrency; reporting each
        one at once would cost the scaler and this process far more than the request.
        """
        if not self._lazy:
            self._lazy = True
            self._wake.set()

    def _due(self, now: float) -> float:
        if self._urgent:
            return now
        return self._last_sent + (LAZY_INTERVAL if self._lazy else self._interval)

    def report(self, withdraw: bool = False) -> demand_pb2.DemandReport:
        self._sequence += 1
        models: dict[str, demand_pb2.ModelDemand] = {}
        for key, (queued, leases, failures_seen) in self._cold().items():
            models[key] = demand_pb2.ModelDemand(model=key, queued=queued, leases=leases, failures_seen=failures_seen)
        for key, count in self._in_flight().items():
            if count:
                models.setdefault(key, demand_pb2.ModelDemand(model=key)).in_flight = count
        for key, adapters in self._adapters().items():
            models.setdefault(key, demand_pb2.ModelDemand(model=key)).adapters.extend(adapters)
        return demand_pb2.DemandReport(
            gateway_id=self._gateway_id,
            instance=self._instance,
            sequence=self._sequence,
            models=[] if withdraw else list(models.values()),
            withdraw=withdraw,
        )

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return self._token.metadata() if self._token is not None else ()

    async def run(self) -> None:
        # Reconnect fast and let a report wait for the connection: a restarted scaler then gets
        # this gateway's state within one report interval instead of after gRPC's 1 s+ backoff.
        options = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
        async with grpc.aio.insecure_channel(self._target, options=options) as channel:
            stub = demand_pb2_grpc.DemandServiceStub(channel)
            try:
                loop = asyncio.get_running_loop()
                while True:
                    # Urgent changes go out at once, lazy ones at most every LAZY_INTERVAL, and
                    # the state at least every interval.
                    now = loop.time()
                    due = self._due(now)
                    if now < due:
                        self._wake.clear()
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._wake.wait(), due - now)
                        continue
                    self._urgent = self._lazy = False
                    self._last_sent = now
                    await self._send(stub, self.report())
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._send(stub, self.report(withdraw=True), timeout=1.0))

    async def _send(
        self, stub: demand_pb2_grpc.DemandServiceStub, report: demand_pb2.DemandReport, timeout: float = 2.0
    ) -> None:
        try:
            reply = await stub.Report(report, timeout=timeout, metadata=self._metadata(), wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            self.failed += 1
            if self.failed == 1 or self.failed % 30 == 0:
                log.warning("demand report failed (%d so far): %s", self.failed, exc.code().name)
            return
        self.sent += 1
        if reply.accepted:
            self._on_delivered()
        else:
            log.warning("demand report refused: %s", reply.reason)
