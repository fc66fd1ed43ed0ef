"""KEDA's `externalscaler.ExternalScaler` gRPC service over the scaler's verdicts.

:class:`Hub` owns when verdicts are computed: it evaluates the pure
:class:`~control.scaler.core.Core` on the next loop turn after a demand change
(coalescing bursts) and at the earliest time a decision said it could change,
and fans the result out to StreamIsActive watchers and any other listener.
:class:`ExternalScalerService` answers KEDA: IsActive and StreamIsActive from
``Verdict.active``; GetMetricSpec/GetMetrics give the model's summed demand
(queued + in-flight) against ``targetInFlight`` per replica, in both the
int64 and the float fields. A ScaledObjectRef names a Model by
``scalerMetadata.model`` (``name`` or ``namespace/name``), else by its own
name (``wg-<model>`` or ``<model>``) in its namespace.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from wakegate.externalscaler import externalscaler_pb2, externalscaler_pb2_grpc

from control.demand import DemandBook
from control.k8s.names import backend_name
from control.scaler.core import Core, Verdict
from control.schema import Model

log = logging.getLogger("wakegate.scaler")

METRIC_NAME = "wakegate-demand"
#: Pending state changes kept per stream; older ones are dropped when KEDA reads slower than they come.
_STREAM_BACKLOG = 8

VerdictListener = Callable[[dict[str, Verdict]], None]


@dataclass(eq=False)
class _Watcher:
    key: str
    pending: list[bool] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def push(self, active: bool) -> None:
        if self.pending and self.pending[-1] == active:
            return
        self.pending.append(active)
        del self.pending[:-_STREAM_BACKLOG]
        self.wake.set()


class Hub:
    def __init__(
        self,
        core: Core,
        *,
        clock: Callable[[], float] = time.monotonic,
        live: Callable[[], Mapping[str, int] | None] = lambda: None,
    ) -> None:
        self.core = core
        self._clock = clock
        self._live = live
        self._listeners: list[VerdictListener] = []
        self._watchers: set[_Watcher] = set()
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self.evaluations = 0

    def add_listener(self, listener: VerdictListener) -> None:
        self._listeners.append(listener)

    @property
    def streams(self) -> int:
        return len(self._watchers)

    def poke(self) -> None:
        """Demand or the model set changed: evaluate on the next loop turn."""
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.evaluate)

    def evaluate(self) -> None:
        self._scheduled = False
        before = self.core.verdicts
        verdicts, next_at = self.core.evaluate(self._clock(), self._live())
        self.evaluations += 1
        for watcher in self._watchers:
            old, new = before.get(watcher.key), verdicts.get(watcher.key)
            if new is None:
                continue
            # Every rise of demand sends `true` again: KEDA scales 0->1 on each `true` it receives.
            if old is None or old.active != new.active or (new.busy and not old.busy):
                watcher.push(new.active)
        for listener in self._listeners:
            listener(verdicts)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if next_at is not None:
            delay = max(0.0, next_at - self._clock())
            self._timer = asyncio.get_running_loop().call_later(delay, self.poke)

    def resolve(self, ref: externalscaler_pb2.ScaledObjectRef) -> str | None:
        """The model key a ScaledObjectRef names, or None when no served model matches."""
        namespace = ref.namespace
        candidates: list[str] = []
        named = ref.scalerMetadata.get("model", "")
        if named:
            candidates += [named] if "/" in named else [f"{namespace}/{named}", named]
        else:
            prefix = backend_name("")
            names = [ref.name[len(prefix) :]] if ref.name.startswith(prefix) else []
            for name in [*names, ref.name]:
                candidates += [f"{namespace}/{name}", name]
        return next((key for key in candidates if key in self.core.models), None)

    def watch(self, key: str) -> _Watcher:
        watcher = _Watcher(key)
        self._watchers.add(watcher)
        return watcher

    def unwatch(self, watcher: _Watcher) -> None:
        self._watchers.discard(watcher)


class ExternalScalerService(externalscaler_pb2_grpc.ExternalScalerServicer):  # type: ignore[misc]
    def __init__(self, hub: Hub) -> None:
        self.hub = hub

    async def _verdict(
        self, ref: externalscaler_pb2.ScaledObjectRef, context: grpc.aio.ServicerContext
    ) -> tuple[str, Verdict]:
        key = self.hub.resolve(ref)
        verdict = None if key is None else self.hub.core.verdicts.get(key)
        if key is None or verdict is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no Model for ScaledObject {ref.namespace}/{ref.name}")
        assert key is not None and verdict is not None  # abort() raises
        return key, verdict

    async def IsActive(
        self, request: externalscaler_pb2.ScaledObjectRef, context: grpc.aio.ServicerContext
    ) -> externalscaler_pb2.IsActiveResponse:
        _, verdict = await self._verdict(request, context)
        return externalscaler_pb2.IsActiveResponse(result=verdict.active)

    async def StreamIsActive(
        self, request: externalscaler_pb2.ScaledObjectRef, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[externalscaler_pb2.IsActiveResponse]:
        key, verdict = await self._verdict(request, context)
        watcher = self.hub.watch(key)
        try:
            # A (re)connecting KEDA gets the current state first.
            watcher.push(verdict.active)
            while True:
                await watcher.wake.wait()
                watcher.wake.clear()
                pending, watcher.pending = watcher.pending, []
                for active in pending:
                    yield externalscaler_pb2.IsActiveResponse(result=active)
        finally:
            self.hub.unwatch(watcher)

    async def GetMetricSpec(
        self, request: externalscaler_pb2.ScaledObjectRef, context: grpc.aio.ServicerContext
    ) -> externalscaler_pb2.GetMetricSpecResponse:
        _, verdict = await self._verdict(request, context)
        target = verdict.target_in_flight
        spec = externalscaler_pb2.MetricSpec(metricName=METRIC_NAME, targetSize=target, targetSizeFloat=float(target))
        return externalscaler_pb2.GetMetricSpecResponse(metricSpecs=[spec])

    async def GetMetrics(
        self, request: externalscaler_pb2.GetMetricsRequest, context: grpc.aio.ServicerContext
    ) -> externalscaler_pb2.GetMetricsResponse:
        _, verdict = await self._verdict(request.scaledObjectRef, context)
        value = externalscaler_pb2.MetricValue(
            metricName=request.metricName or METRIC_NAME,
            metricValue=verdict.demand,
            metricValueFloat=float(verdict.demand),
        )
        return externalscaler_pb2.GetMetricsResponse(metricValues=[value])


@dataclass(frozen=True)
class TlsFiles:
    """Server certificate and key, and the CA that client certificates must chain to (mTLS) if set."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    def credentials(self) -> grpc.ServerCredentials:
        ca = self.client_ca.read_bytes() if self.client_ca is not None else None
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )


async def serve_external_scaler(hub: Hub, address: str, tls: TlsFiles | None = None) -> tuple[grpc.aio.Server, int]:
    """Start a gRPC server with the ExternalScaler service; returns it and its bound port."""
    server = grpc.aio.server()
    externalscaler_pb2_grpc.add_ExternalScalerServicer_to_server(ExternalScalerService(hub), server)
    port = server.add_secure_port(address, tls.credentials()) if tls else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    await server.start()
    return server, port


async def serve_local(
    book: DemandBook, models: list[Model], address: str, clock: Callable[[], float] = time.monotonic
) -> tuple[grpc.aio.Server, Hub, int]:
    """ExternalScaler for `wakegate up --scaler-listen`: the caller pokes the hub on demand changes."""
    core = Core(book)
    core.set_models(models, clock())
    hub = Hub(core, clock=clock)
    hub.evaluate()
    server, port = await serve_external_scaler(hub, address)
    log.info("external scaler (KEDA protocol) on %s", address.rsplit(":", 1)[0] + f":{port}")
    return server, hub, port
