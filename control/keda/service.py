"""KEDA's `externalscaler.ExternalScaler` gRPC service over the scaling core's verdicts.

Verdicts come from a :class:`~wakegate.control.keda.hub.Hub`. :class:`ExternalScalerService`
answers KEDA: IsActive and StreamIsActive from ``Verdict.active``; GetMetricSpec/GetMetrics
give the model's summed demand (queued + in-flight) against ``targetInFlight`` per replica,
in both the int64 and the float fields.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from wakegate.control.demand.book import DemandBook
from wakegate.control.keda.hub import Hub
from wakegate.control.scaling.core import Core, Verdict
from wakegate.control.schema import Model
from wakegate.externalscaler import externalscaler_pb2, externalscaler_pb2_grpc

log = logging.getLogger("wakegate.scaler")

METRIC_NAME = "wakegate-demand"


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
