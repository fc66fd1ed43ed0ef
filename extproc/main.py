"""`wakegate extproc`: the ext_proc gRPC server, its route feed and admin port.

Shutdown: the first SIGTERM/SIGINT stops admitting new streams and lets
in-flight ones finish (bounded by --drain-seconds); a second one exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from wakegate import internal_token
from wakegate.extproc import activator, admin
from wakegate.extproc.auth import ApiKeys, AuthConfigError
from wakegate.extproc.completions import STREAM_ACCESS_LOGS_METHOD, Completions
from wakegate.extproc.demand import DemandReporter
from wakegate.extproc.engines import EngineWatch
from wakegate.extproc.feed import RouteFeed
from wakegate.extproc.gateway import Gateway
from wakegate.extproc.gateway import Settings as GatewaySettings
from wakegate.extproc.h2grpc.call import INVALID_ARGUMENT, NOT_FOUND, GrpcError, GrpcServer, unary
from wakegate.extproc.h2grpc.limits import H2Limits
from wakegate.extproc.kvsubscriber import KVSubscriber
from wakegate.extproc.native import NativeCounts
from wakegate.extproc.park import Parker, Tickets
from wakegate.extproc.service import EXT_PROC_SERVICE, PROCESS_METHOD, Processor
from wakegate.gateway_flags import add_request_arguments
from wakegate.internal_token import TokenSource
from wakegate.process import ProcessSettings, add_log_level, graceful_exit, host_port, settings_from, start

log = logging.getLogger("wakegate.extproc")

HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen", default="127.0.0.1:9002", help="gRPC address Envoy connects to (HOST:PORT or unix:PATH)"
    )
    parser.add_argument("--admin-listen", default="127.0.0.1:9003", help="HTTP address for /healthz and /metrics")
    parser.add_argument("--xds", required=True, help="address of the xDS feeder (HOST:PORT)")
    parser.add_argument(
        "--activator-listen",
        default="127.0.0.1:9004",
        help="HTTP address of the activator (keepalive cold mode); loopback only",
    )
    parser.add_argument("--demand", default=None, help="address of the demand receiver (HOST:PORT); defaults to --xds")
    parser.add_argument(
        "--envoy-admin",
        default=None,
        type=_address,
        metavar="HOST:PORT",
        help="admin API of this gateway's Envoy (loopback): count the requests it routes alone (routing.path "
        "native) in this extproc's demand reports; omit where nothing else is in front of it (`wakegate up` "
        "counts them itself)",
    )
    internal_token.add_arguments(parser, server=False)
    parser.add_argument(
        "--keepalive-seconds",
        type=float,
        default=2.0,
        help="interval of SSE heartbeats while a keepalive request waits",
    )
    parser.add_argument(
        "--node-id", default=f"extproc-{socket.gethostname()}-{os.getpid()}", help="this process's id in demand reports"
    )
    parser.add_argument(
        "--gateway-id",
        default=None,
        help="xDS node id: its Envoy's node id, whose acknowledgements gate this extproc's routes (default: --node-id)",
    )
    add_request_arguments(parser, metrics_elsewhere="on --admin-listen at /metrics")
    parser.add_argument("--drain-seconds", type=float, default=30.0, help="time in-flight streams get to finish")
    parser.add_argument(
        "--h2-limit",
        action="append",
        default=[],
        type=_h2_limit,
        metavar="NAME=VALUE",
        help="one limit of the HTTP/2 server Envoy connects to (repeatable; docs/decisions.md). "
        f"Defaults: {H2Limits.names()}",
    )
    parser.add_argument(
        "--engine-metrics-interval",
        type=float,
        default=0.5,
        help="seconds between reads of /metrics of the endpoints of models picked by scoring (waiting "
        "requests, KV-cache usage); 0 = never read them",
    )
    parser.add_argument(
        "--release-on",
        choices=("access-log", "stream"),
        default="access-log",
        help="what ends a routed request's in-flight count: Envoy's access-log entry (the ext_proc stream "
        "ends once the request is decided) or the end of its ext_proc stream (kept open meanwhile)",
    )
    add_log_level(parser)


def _address(text: str) -> str:
    """argparse type of a HOST:PORT address."""
    try:
        host_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _h2_limit(text: str) -> str:
    """argparse type of `--h2-limit`: NAME=VALUE for a known limit with a valid value."""
    try:
        H2Limits().with_overrides([text])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


@dataclass(frozen=True, kw_only=True)
class Settings(ProcessSettings):
    """Everything one extproc process is configured with; built once from its command line."""

    listen: str
    """gRPC address Envoy's ext_proc filter connects to (HOST:PORT or unix:PATH)."""
    admin_listen: str
    """HTTP address of /healthz, /metrics and /wakegate/queue."""
    activator_listen: str
    """HTTP address of the activator (keepalive cold mode); loopback only."""
    xds: str
    """The xDS feeder (HOST:PORT) the route table comes from."""
    demand: str
    """Where demand reports go (HOST:PORT)."""
    envoy_admin: str | None
    """Admin API of this gateway's Envoy, polled for its natively routed requests; None: not polled."""
    internal_token: TokenSource
    """The internal token presented to the feeder and the demand service (a file, else the environment)."""
    node_id: str
    """This process's id in demand reports."""
    gateway_id: str
    """The xDS node id: the same as its Envoy's, so the feeder gates routes by that Envoy's acknowledgements."""
    api_keys_file: Path | None
    """API keys, one per line with an optional scope of models, re-read on change; None: no auth."""
    public_metrics: str
    """`/metrics` on the public listener: off, open or keys (also in `gateway`)."""
    keepalive_seconds: float
    """SSE heartbeat interval while a keepalive request waits."""
    drain_seconds: float
    """How long in-flight streams may finish after the first signal."""
    engine_metrics_interval: float
    """Seconds between reads of scored endpoints' /metrics; 0: never."""
    release_on: str
    """`access-log`: requests are released by Envoy's access-log entries; `stream`: by their ext_proc stream."""
    gateway: GatewaySettings
    """How each request is decided."""
    h2_limits: H2Limits
    """What one connection to the HTTP/2 server may cost (`--h2-limit`)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        gateway = GatewaySettings(
            max_body_bytes=args.max_body_bytes,
            global_rate=args.global_rps,
            global_burst=args.global_burst,
            public_metrics=args.public_metrics,
            fairness_header=args.fairness_header,
        )
        limits = H2Limits().with_overrides(getattr(args, "h2_limit", []))
        token = internal_token.source_from(args, server=False)
        assert token is not None  # a client always has a source; it may hold no token
        return settings_from(
            cls,
            args,
            demand=args.demand or args.xds,
            gateway=gateway,
            h2_limits=limits,
            internal_token=token,
            gateway_id=args.gateway_id or args.node_id,
        )


def main(args: argparse.Namespace) -> int:
    return start(args, Settings.from_args, run, "extproc")


def run(settings: Settings) -> int:
    try:
        keys = ApiKeys(settings.api_keys_file)
    except AuthConfigError as exc:
        log.error("%s", exc)
        return 2
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    return asyncio.run(serve(settings, Gateway(settings.gateway, keys)))


async def serve(settings: Settings, gateway: Gateway) -> int:
    serving = True

    def check_health(data: bytes) -> bytes:
        try:
            request = health_pb2.HealthCheckRequest.FromString(data)
        except DecodeError:
            raise GrpcError(INVALID_ARGUMENT, "not a HealthCheckRequest") from None
        if request.service not in ("", EXT_PROC_SERVICE):
            raise GrpcError(NOT_FOUND, f"unknown service {request.service!r}")
        # Serving once the first route table arrived: a standby that just restarted takes traffic
        # back only when it can route it.
        ready = serving and gateway.synced
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        return bytes(health_pb2.HealthCheckResponse(status=status).SerializeToString())

    # Both extprocs of a gateway share its internal token, so a ticket one signs the other reads.
    tickets = Tickets.from_token(settings.internal_token.value())
    processor = Processor(gateway, tickets)
    parker = Parker(processor, tickets)
    methods = {PROCESS_METHOD: processor.call, HEALTH_CHECK_METHOD: unary(check_health)}
    if settings.release_on == "access-log":
        gateway.completions = Completions(gateway.finished)
        gateway.completions.on_usage = gateway.used_tokens
        methods[STREAM_ACCESS_LOGS_METHOD] = gateway.completions.call
    server = GrpcServer(
        methods,
        max_message_bytes=settings.gateway.max_body_bytes + 1024 * 1024,
        limits=settings.h2_limits,
        http=parker.stream,
    )
    gateway.metrics.watch_h2(server.transport.refused)
    try:
        # Bound now (a port some server listens on is an error at once), accepting once the first route table is
        # here (`_serve_when_synced`): until then Envoy's connections are refused, so its ext_proc
        # streams go to the other extproc instead of meeting one that cannot route yet.
        await server.listen(settings.listen, serving=False)
    except (OSError, ValueError) as exc:
        log.error("cannot listen on %s: %s", settings.listen, exc)
        return 2
    if settings.internal_token.value() is None:
        log.warning(
            "no internal token (%s): the feeder and the scaler will refuse this gateway unless they run without auth",
            settings.internal_token.describe(),
        )
    feed = RouteFeed(settings.xds, settings.gateway_id, gateway.update_routes, token=settings.internal_token)
    native = NativeCounts(settings.envoy_admin, gateway) if settings.envoy_admin else None
    reporter = DemandReporter(
        settings.demand,
        settings.node_id,
        gateway.held,
        native.reported if native is not None else lambda: gateway.in_flight,
        token=settings.internal_token,
        on_delivered=gateway.demand_delivered,
        adapters=gateway.adapters.report,
    )
    gateway.on_demand_change = reporter.changed
    gateway.on_load_change = reporter.changed_lazily
    if native is not None:
        native.on_change = reporter.changed_lazily
    host, port = host_port(settings.admin_listen)
    runner = await admin.start(gateway, feed.synced.is_set, host, port)
    keepalive = activator.Activator(gateway, settings.keepalive_seconds)
    host, port = host_port(settings.activator_listen)
    activator_runner = await activator.start(keepalive, host, port)
    tasks = [
        asyncio.create_task(feed.run()),
        asyncio.create_task(reporter.run()),
        asyncio.create_task(_expire_leases(gateway)),
    ]
    if native is not None:
        tasks.append(asyncio.create_task(native.run()))
    if settings.engine_metrics_interval > 0:
        picker = gateway.picker
        watch = EngineWatch(
            picker.scored_endpoints,
            picker.engines,
            picker.inflight.count,
            settings.engine_metrics_interval,
            on_round=gateway.flow.engines_read,
        )
        tasks.append(asyncio.create_task(watch.run()))
    kv = KVSubscriber(gateway.picker.kv_targets, gateway.picker.kv)
    tasks.append(asyncio.create_task(kv.run()))
    stop = asyncio.Event()
    graceful_exit(stop, "extproc")
    failed: list[str] = []
    tasks.append(asyncio.create_task(_serve_when_synced(server, settings.listen, feed.synced, stop, failed)))
    log.info(
        "extproc ready listen=%s admin=%s xds=%s auth=%s public-metrics=%s",
        settings.listen,
        settings.admin_listen,
        settings.xds,
        "on" if gateway.keys.enabled else "off",
        settings.gateway.public_metrics,
    )
    await stop.wait()
    log.info("extproc draining (up to %.0fs)", settings.drain_seconds)
    serving = False
    held = processor.let_go() + parker.let_go()
    if held:
        log.info("answered %d held request(s) with the retriable 503: stopping", held)
    if gateway.completions is not None:
        gateway.completions.close()
    await server.stop(settings.drain_seconds)
    await activator_runner.cleanup()
    await keepalive.close()
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await runner.cleanup()
    log.info("extproc stopped")
    return 2 if failed else 0


#: How long a new extproc refuses ext_proc connections while it has no route table. After that it
#: accepts them anyway (its feeder may be down for long): requests then get `gateway_starting`,
#: and Envoy's health checks, which see NOT_SERVING until the table arrives, still prefer the
#: other extproc.
UNSYNCED_SERVE_SECONDS = 5.0


async def _serve_when_synced(
    server: GrpcServer, listen: str, synced: asyncio.Event, stop: asyncio.Event, failed: list[str]
) -> None:
    """Start accepting on `listen` once `synced` (or after UNSYNCED_SERVE_SECONDS); a port taken
    meanwhile stops the process (exit status 2)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(synced.wait(), UNSYNCED_SERVE_SECONDS)
    if stop.is_set():
        return  # stopping before it ever served
    if not synced.is_set():
        log.warning("no route table after %.0fs: accepting ext_proc streams anyway", UNSYNCED_SERVE_SECONDS)
    try:
        await server.start_serving()
    except OSError as exc:
        log.error("cannot listen on %s: %s", listen, exc)
        failed.append(listen)
        stop.set()


async def _expire_leases(gateway: Gateway) -> None:
    """End activation leases on time, so demand reports stop carrying them."""
    while True:
        next_end = gateway.cold.expire()
        gateway.flow.kick_all()  # whatever no event dispatched (an engine that is not read)
        await asyncio.sleep(min(next_end, 1.0) if next_end is not None else 1.0)
