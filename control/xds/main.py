"""`wakegate xds`: the xDS feeder for a cluster — watches Models and EndpointSlices, serves ADS.

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
from collections.abc import Mapping
from typing import Any

from wakegate.process import graceful_exit


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="0.0.0.0:18000", help="ADS gRPC address for Envoy and extproc")
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG, else in-cluster)")
    parser.add_argument(
        "--gateway-listen", default="0.0.0.0:8080", help="address the gateway's Envoy listener binds (HOST:PORT)"
    )
    parser.add_argument("--max-request-bytes", type=int, default=8 * 1024 * 1024)
    parser.add_argument("--upstream-header", action="store_true", help="add x-wakegate-upstream to responses")
    parser.add_argument("--log-level", default="info")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kopf").setLevel(logging.WARNING)
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    import kopf

    from wakegate.control.admin import host_port
    from wakegate.control.feeder.ads import AdsServer, start_server
    from wakegate.control.feeder.cache import SnapshotCache
    from wakegate.control.feeder.kube_source import KubeSource
    from wakegate.control.feeder.resources import GatewaySettings, build
    from wakegate.control.k8s import names
    from wakegate.control.k8s.client import api_client, connection_info

    log = logging.getLogger("wakegate.xds")
    host, port = host_port(args.gateway_listen, "0.0.0.0")
    gateway = GatewaySettings(
        listen_host=host,
        listen_port=port,
        max_request_bytes=args.max_request_bytes,
        upstream_header=args.upstream_header,
    )
    source = KubeSource()
    cache = SnapshotCache()
    ads: AdsServer | None = None
    pending = False

    async def publish() -> None:
        nonlocal pending
        pending = False
        routed = source.routed()
        if ads is None:
            await cache.set(build(routed, gateway))
        else:
            await cache.set(build(routed, gateway, ads.confirmed(), ads.retained()))

    def publish_soon() -> None:
        nonlocal pending
        if not pending:
            pending = True
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(publish()))

    async def model_event(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        source.on_model(event.get("type"), body)
        publish_soon()

    async def slice_event(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        source.on_slice(event.get("type"), body)
        publish_soon()

    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(**connection_info(api_client(args.kubeconfig).configuration))

    registry = kopf.OperatorRegistry()
    kopf.on.login(registry=registry)(login)
    kopf.on.event(names.GROUP, names.VERSION, names.MODEL_PLURAL, registry=registry)(model_event)
    kopf.on.event(
        "discovery.k8s.io",
        "v1",
        "endpointslices",
        labels={names.LABEL_COMPONENT: "model-backend", names.LABEL_MANAGED_BY: names.MANAGED_BY},
        registry=registry,
    )(slice_event)
    settings = kopf.OperatorSettings()
    settings.posting.enabled = False

    await publish()
    server, ads, bound = await start_server(cache, args.listen, on_endpoints_acked=publish_soon)
    log.info("wakegate xds: ADS on port %d, gateway listener %s", bound, args.gateway_listen)
    print(f"wakegate xds: listening on port {bound}", flush=True)
    stop = asyncio.Event()
    graceful_exit(stop, "xds")
    operator = asyncio.create_task(
        kopf.operator(registry=registry, settings=settings, standalone=True, clusterwide=True, stop_flag=stop)
    )
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({operator, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.set()
        stopped.cancel()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(operator, 10)
        # Kopf cancels the tasks started while it ran, the ADS streams' among them.
        with contextlib.suppress(asyncio.CancelledError):
            await server.stop(1)
    if operator.done() and not operator.cancelled() and operator.exception() is not None:
        log.error("watch failed: %r", operator.exception())
        return 1
    return 0
