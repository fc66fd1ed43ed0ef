"""`wakegate xds`: the xDS feeder for a cluster — watches Models and EndpointSlices, serves ADS.

Every ADS stream must carry the internal token (wakegate.internal_token) unless it runs
with `--no-internal-auth`; a refused stream is counted on `--admin-listen`'s /metrics.
Read-only on the cluster (list/watch Models and EndpointSlices; Kopf in
standalone mode with event handlers only, so it never writes). Every watch
event schedules one coalesced snapshot build (push on change, never poll); the
same builder, cache and ADS server as `wakegate up`. Any number of replicas may
run: they hold no state beyond the watch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from wakegate import internal_token
from wakegate.control import admin
from wakegate.control.feeder.settings import GatewaySettings
from wakegate.control.k8s.client import add_kubeconfig
from wakegate.internal_token import Authenticator, TokenSource
from wakegate.process import ProcessSettings, add_log_level, graceful_exit, host_port, settings_from, start

if TYPE_CHECKING:
    from wakegate.control.feeder.kube_source import KubeSource, Listed

log = logging.getLogger("wakegate.xds")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="0.0.0.0:18000", help="ADS gRPC address for Envoy and extproc")
    add_kubeconfig(parser)
    parser.add_argument(
        "--gateway-listen", default="0.0.0.0:8080", help="address the gateway's Envoy listener binds (HOST:PORT)"
    )
    parser.add_argument(
        "--max-request-bytes", type=int, default=8 * 1024 * 1024, help="largest request body a gateway buffers, bytes"
    )
    parser.add_argument("--upstream-header", action="store_true", help="add x-wakegate-upstream to responses")
    parser.add_argument(
        "--native-path",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="let Models that ask for routing.path native be routed by Envoy alone while warm; only where no "
        "gateway checks API keys or a global rate limit (native routes check neither) and each extproc counts "
        "its Envoy's native requests (--envoy-admin): the chart sets it so",
    )
    parser.add_argument(
        "--replay",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a request whose extproc died or stalled before deciding it (no model server saw it) goes through "
        "the gateway's Envoy again and is held by the restarted extproc instead of failing with a 503; the "
        "bootstrap's internal listener and replay cluster must be there (the chart's are)",
    )
    parser.add_argument(
        "--admin-listen", default=None, help="HTTP address for /metrics and /healthz (HOST:PORT); none by default"
    )
    internal_token.add_arguments(parser, server=True)
    add_log_level(parser)


@dataclass(frozen=True, kw_only=True)
class Settings(ProcessSettings):
    """Everything `wakegate xds` is configured with; built once from its command line."""

    listen: str
    """ADS gRPC address for Envoy and extproc."""
    kubeconfig: str | None
    """Where the cluster is (the seam's lookup order when None)."""
    gateway: GatewaySettings
    """The Envoy listener every gateway gets (address, body limit, debug header, native path allowed, replay)."""
    admin_listen: str | None
    """HTTP address of /metrics and /healthz; None: not served."""
    internal_token: TokenSource | None
    """The token every ADS stream must carry; None: none asked (`--no-internal-auth`)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        """Raises ValueError for a malformed --gateway-listen."""
        host, port = host_port(args.gateway_listen, "0.0.0.0")
        gateway = GatewaySettings(
            listen_host=host,
            listen_port=port,
            max_request_bytes=args.max_request_bytes,
            upstream_header=args.upstream_header,
            native_allowed=args.native_path,
            replay=args.replay,
        )
        if args.admin_listen is not None:
            host_port(args.admin_listen, "0.0.0.0")
        token = internal_token.source_from(args, server=True)
        return settings_from(cls, args, gateway=gateway, internal_token=token)


def main(args: argparse.Namespace) -> int:
    return start(args, Settings.from_args, lambda settings: asyncio.run(run(settings)), "xds", quiet=("kopf",))


async def run(settings: Settings) -> int:
    import kopf

    from wakegate.control.feeder.ads import start_server
    from wakegate.control.feeder.cache import SnapshotCache
    from wakegate.control.feeder.kube_source import KubeSource
    from wakegate.control.feeder.publisher import Publisher
    from wakegate.control.k8s import kopfing, names

    source = KubeSource()
    publisher = Publisher(SnapshotCache(), settings.gateway, source.routed)

    async def model_event(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        source.on_model(event.get("type"), body)
        publisher.publish_soon()

    async def slice_event(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        source.on_slice(event.get("type"), body)
        publisher.publish_soon()

    async def adapter_event(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        if source.on_adapter(event.get("type"), body):
            publisher.publish_soon()

    registry = kopfing.registry(settings.kubeconfig)
    kopf.on.event(names.GROUP, names.VERSION, names.MODEL_PLURAL, registry=registry)(model_event)
    kopf.on.event(names.GROUP, names.VERSION, names.LORAADAPTER_PLURAL, registry=registry)(adapter_event)
    kopf.on.event(
        "discovery.k8s.io",
        "v1",
        "endpointslices",
        labels={names.LABEL_COMPONENT: "model-backend", names.LABEL_MANAGED_BY: names.MANAGED_BY},
        registry=registry,
    )(slice_event)

    async def node_event(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        if source.on_node(event.get("type"), body):
            publisher.publish_soon()

    kopf.on.event("", "v1", "nodes", registry=registry)(node_event)

    stop = asyncio.Event()
    graceful_exit(stop, "xds")
    # Before the watches start: their discovery, run while the apiserver still comes up, can find
    # no wakegate API and then never watch Models. A plain list that answers means it is served.
    listed = await list_routable(settings.kubeconfig, stop)
    operator = asyncio.create_task(kopfing.run(registry, stop, signals=lambda: graceful_exit(stop, "xds")))
    if listed is None or not await synced(source, listed, operator, stop):
        stop.set()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(operator, 10)
        return 0 if listed is None else 1
    await publisher.publish()
    authenticator = Authenticator(settings.internal_token) if settings.internal_token is not None else None
    server, publisher.ads, bound = await start_server(
        publisher.cache, settings.listen, on_endpoints_acked=publisher.publish_soon, authenticator=authenticator
    )
    admin_runner = await _serve_admin(settings.admin_listen, authenticator)
    log.info(
        "wakegate xds: ADS on port %d (%s), gateway listener %s:%d, native path %s",
        bound,
        f"internal token from {settings.internal_token.describe()}" if settings.internal_token else "no auth",
        settings.gateway.listen_host,
        settings.gateway.listen_port,
        "allowed" if settings.gateway.native_allowed else "off",
    )
    print(f"wakegate xds: listening on port {bound}", flush=True)
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({operator, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.set()
        stopped.cancel()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(operator, 10)
        # The ADS streams end with the server (Kopf leaves the process's own tasks alone).
        with contextlib.suppress(asyncio.CancelledError):
            await server.stop(1)
        if admin_runner is not None:
            await admin_runner.cleanup()
    if operator.done() and not operator.cancelled() and operator.exception() is not None:
        log.error("watch failed: %r", operator.exception())
        return 1
    return 0


#: How long the watches may take to deliver what the first list found before the feeder gives up
#: and exits (to be started again): serving less would replace the gateways' working routes.
SYNC_TIMEOUT_SECONDS = 60.0


async def list_routable(kubeconfig: str | None, stop: asyncio.Event) -> Listed | None:
    """The Models, model backends' EndpointSlices and LoRAAdapters on the cluster now; listed again
    (every 1 s, one warning a minute) until the apiserver answers. None: stopped first."""
    from wakegate.control.feeder.kube_source import Listed
    from wakegate.control.k8s import names
    from wakegate.control.k8s.client import Kube, KubeError, api_client, path

    kube = Kube(api_client(kubeconfig))
    selector = f"{names.LABEL_COMPONENT}=model-backend,{names.LABEL_MANAGED_BY}={names.MANAGED_BY}"

    def items(resource: str, query: dict[str, str] | None = None, missing_ok: bool = False) -> list[dict[str, Any]]:
        try:
            return list(kube.request("GET", resource, query=query)["items"])
        except KubeError as exc:
            if missing_ok and exc.status == 404:
                return []  # no LoRAAdapter CRD installed
            raise

    def once() -> Listed:
        return Listed.of(
            items(path(names.API_VERSION, "Model")),
            items("/apis/discovery.k8s.io/v1/endpointslices", {"labelSelector": selector}),
            items(path(names.API_VERSION, "LoRAAdapter"), missing_ok=True),
        )

    warned = -math.inf
    while not stop.is_set():
        try:
            return await asyncio.to_thread(once)
        except KubeError as exc:
            if time.monotonic() - warned >= 60:
                warned = time.monotonic()
                log.warning("cannot list Models yet (%s); no routes are served until it answers", exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
    return None


async def synced(source: KubeSource, listed: Listed, watches: asyncio.Task[None], stop: asyncio.Event) -> bool:
    """Wait until the watches delivered everything `listed` names; False if they did not within
    SYNC_TIMEOUT_SECONDS (an object deleted since the list never arrives: a restart lists anew)."""
    deadline = time.monotonic() + SYNC_TIMEOUT_SECONDS
    while not source.holds(listed):
        if stop.is_set() or watches.done():
            return False
        if time.monotonic() > deadline:
            log.error(
                "the watches did not deliver the %d Models and %d EndpointSlices listed within %.0f s; exiting",
                len(listed.models),
                len(listed.slices),
                SYNC_TIMEOUT_SECONDS,
            )
            return False
        await asyncio.sleep(0.1)
    log.info("watches synced: %d Models, %d EndpointSlices", len(listed.models), len(listed.slices))
    return True


async def _serve_admin(listen: str | None, authenticator: Authenticator | None) -> web.AppRunner | None:
    if listen is None:
        return None
    registry = CollectorRegistry()
    if authenticator is not None:
        registry.register(admin.RefusedCalls(authenticator, ("ads",)))

    async def metrics(_: web.Request) -> web.Response:
        return admin.metrics_response(registry)

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    host, port = host_port(listen, "0.0.0.0")
    return await admin.serve({"/metrics": metrics, "/healthz": healthz}, host, port)
