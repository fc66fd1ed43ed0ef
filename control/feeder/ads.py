"""ADS stream server (state of the world) answering watches from the SnapshotCache.

ACK/NACK bookkeeping lives here and only here: per stream and type URL we keep
the names watched, the nonce and version last sent, and whether the client is
waiting for a response. A NACK is logged with the client's reason and leaves
the stream waiting for the next change, so a bad config never wedges it.

What each stream acknowledged is kept per stream and grouped by node id: a gateway is
the Envoy and the extproc(s) that share one node id, and only a gateway's own
acknowledgements gate what that gateway is sent (`confirmed`, `retained`). Each
stream serves the view of its own node from the cache, so a silent or rejecting
subscriber holds back nothing but itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.route.v3 import route_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from wakegate.control.feeder.cache import SnapshotCache
from wakegate.control.feeder.h2guard import GRPC_OPTIONS, FrameBudget, GuardedServer, serve_guarded
from wakegate.control.feeder.resources import (
    ENDPOINT,
    MODEL_ROUTE,
    ROUTE,
    WILDCARD_TYPES,
    Resources,
    natively_routed,
    pack,
    version_of,
)
from wakegate.internal_token import Authenticator
from wakegate.v1 import routing_pb2

log = logging.getLogger("wakegate.xds")

_nonces = itertools.count(1)

#: How long a refused ADS stream is kept open for its first request (see StreamAggregatedResources).
REFUSAL_READ_SECONDS = 1.0


@dataclass
class _Watch:
    names: frozenset[str] = frozenset()
    sent: dict[str, Message] = field(default_factory=dict)
    sent_version: str | None = None
    sent_names: frozenset[str] | None = None
    nonce: str = ""
    waiting: bool = False
    acked_version: str = ""


@dataclass
class StreamStats:
    """Counters a test or the admin endpoint can read."""

    acks: int = 0
    nacks: int = 0
    responses: int = 0
    last_nack: str = ""
    nodes: dict[str, int] = field(default_factory=dict)


Acked = dict[str, frozenset[tuple[str, int]]]
"""cluster -> endpoints one stream acknowledged."""


class AdsServer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):  # type: ignore[misc]
    def __init__(
        self,
        cache: SnapshotCache,
        on_endpoints_acked: Callable[[], None] = lambda: None,
        authenticator: Authenticator | None = None,
    ) -> None:
        self._cache = cache
        self.stats = StreamStats()
        self._on_endpoints_acked = on_endpoints_acked
        self._authenticator = authenticator
        self._streams = itertools.count(1)
        #: type URL -> stream -> (node, what that stream acknowledged). Envoys acknowledge
        #: EDS (ENDPOINT) and their routes (ROUTE: the clusters routed natively, no endpoints),
        #: extprocs acknowledge ModelRoutes.
        self._acked: dict[str, dict[int, tuple[str, Acked]]] = {ENDPOINT: {}, MODEL_ROUTE: {}, ROUTE: {}}

    def gateways(self) -> set[str]:
        """Node ids with at least one acknowledgement on record: the gateways that get their own view."""
        return {node for streams in self._acked.values() for node, _ in streams.values()}

    def confirmed(self, node: str) -> Acked | None:
        """cluster -> endpoints every Envoy stream of this node acknowledged; None when it has none."""
        streams = [acked for n, acked in self._acked[ENDPOINT].values() if n == node]
        if not streams:
            return None
        clusters = set().union(*(set(a) for a in streams))
        return {c: frozenset.intersection(*(a.get(c, frozenset()) for a in streams)) for c in clusters}

    def retained(self, node: str) -> Acked:
        """cluster -> endpoints some extproc of this node may still pick (it has not acknowledged their removal)."""
        out: Acked = {}
        for n, clusters in self._acked[MODEL_ROUTE].values():
            if n != node:
                continue
            for cluster, endpoints in clusters.items():
                out[cluster] = out.get(cluster, frozenset()) | endpoints
        return out

    def routed_natively(self, node: str) -> frozenset[str]:
        """Clusters some Envoy of this node may still route to natively (its acknowledged routes)."""
        return frozenset(c for n, clusters in self._acked[ROUTE].values() if n == node for c in clusters)

    async def StreamAggregatedResources(
        self,
        request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        if self._authenticator is not None and not self._authenticator.allows(context, "ads"):
            # Take the client's first request (waiting at most REFUSAL_READ_SECONDS) before ending
            # the stream: a gRPC Python client whose first write races the refusal sees its own
            # INTERNAL ("Failed execute_batch") instead of UNAUTHENTICATED.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(anext(aiter(request_iterator)), REFUSAL_READ_SECONDS)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid wakegate token")
        stream = next(self._streams)
        watches: dict[str, _Watch] = {}
        requests: asyncio.Queue[discovery_pb2.DiscoveryRequest | None] = asyncio.Queue()
        node_id = ""

        async def read() -> None:
            try:
                async for request in request_iterator:
                    await requests.put(request)
            finally:
                await requests.put(None)

        reader = asyncio.create_task(read())
        serial = -1
        try:
            while True:
                # Answer whatever is due, then wait for a request or a cache change.
                if serial != self._cache.serial:
                    serial = self._cache.serial
                view = self._cache.view(node_id)
                for type_url, watch in watches.items():
                    response = self._respond(view, type_url, watch)
                    if response is not None:
                        yield response
                get = asyncio.ensure_future(requests.get())
                change = asyncio.ensure_future(self._cache.wait_newer(serial))
                done, _ = await asyncio.wait({get, change}, return_when=asyncio.FIRST_COMPLETED)
                if change not in done:
                    change.cancel()
                if get not in done:
                    get.cancel()
                    continue
                request = get.result()
                if request is None:
                    return
                if request.node.id and request.node.id != node_id:
                    node_id = request.node.id
                    self.stats.nodes[node_id] = self.stats.nodes.get(node_id, 0) + 1
                    log.info("xds stream opened node=%s", node_id)
                self._on_request(stream, node_id, request, watches.setdefault(request.type_url, _Watch()))
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            if node_id:
                log.info("xds stream closed node=%s", node_id)
            removed = [acks.pop(stream, None) for acks in self._acked.values()]
            if any(r is not None for r in removed):
                self._on_endpoints_acked()

    def _on_request(self, stream: int, node_id: str, request: discovery_pb2.DiscoveryRequest, watch: _Watch) -> None:
        if request.response_nonce and request.response_nonce != watch.nonce:
            return  # answer to an older response; the newer one is still pending
        watch.names = frozenset(request.resource_names)
        if request.HasField("error_detail"):
            self.stats.nacks += 1
            self.stats.last_nack = request.error_detail.message
            log.warning(
                "xds NACK node=%s type=%s version=%s reason=%s",
                node_id,
                request.type_url.rsplit(".", 1)[-1],
                watch.sent_version,
                request.error_detail.message,
            )
        elif request.response_nonce:
            self.stats.acks += 1
            watch.acked_version = request.version_info
            if request.type_url in self._acked:
                self._record_endpoints(stream, node_id, request.type_url, watch)
        watch.waiting = True

    def _record_endpoints(self, stream: int, node_id: str, type_url: str, watch: _Watch) -> None:
        acked: Acked = {}
        for message in watch.sent.values():
            if isinstance(message, routing_pb2.ModelRoute):
                acked[message.cluster] = frozenset((e.address, e.port) for e in message.endpoints)
            elif isinstance(message, route_pb2.RouteConfiguration):
                acked.update((cluster, frozenset()) for cluster in natively_routed(message))
            elif isinstance(message, endpoint_pb2.ClusterLoadAssignment):
                acked[message.cluster_name] = frozenset(
                    (lb.endpoint.address.socket_address.address, lb.endpoint.address.socket_address.port_value)
                    for locality in message.endpoints
                    for lb in locality.lb_endpoints
                )
        earlier = self._acked[type_url].get(stream)
        if type_url == ENDPOINT and earlier is not None:
            # EDS is per name: names not in this response keep their earlier acknowledgement.
            acked = {**earlier[1], **acked}
        if earlier != (node_id, acked):
            self._acked[type_url][stream] = (node_id, acked)
            self._on_endpoints_acked()

    def _respond(self, view: Resources, type_url: str, watch: _Watch) -> discovery_pb2.DiscoveryResponse | None:
        if not watch.waiting:
            return None
        selected = view.select(type_url, watch.names)
        if type_url not in WILDCARD_TYPES and not watch.names:
            return None  # a named type with nothing named yet: nothing to say
        version = version_of(selected)
        if version == watch.sent_version and watch.names == watch.sent_names:
            return None
        watch.nonce = str(next(_nonces))
        watch.sent = selected
        watch.sent_version = version
        watch.sent_names = watch.names
        watch.waiting = False
        self.stats.responses += 1
        return discovery_pb2.DiscoveryResponse(
            version_info=version,
            type_url=type_url,
            nonce=watch.nonce,
            resources=[pack(selected[name]) for name in sorted(selected)],
        )


async def start_server(
    cache: SnapshotCache,
    listen: str,
    extra: Callable[[grpc.aio.Server], None] | None = None,
    on_endpoints_acked: Callable[[], None] = lambda: None,
    authenticator: Authenticator | None = None,
    budget: FrameBudget | None = None,
) -> tuple[GuardedServer, AdsServer, int]:
    """Start the ADS gRPC server with the standard health service; returns the bound port.

    `extra` registers more services on the same server (the demand service in `wakegate up`).
    With an `authenticator`, every ADS stream must carry the internal token (the health
    service stays open: it tells nothing but "serving"). grpcio listens on a loopback port
    of its own; `listen` is the `FrameGuard` in front of it (h2guard.py: grpc-core cannot
    cut a PING or SETTINGS flood by itself).
    """
    server = grpc.aio.server(options=GRPC_OPTIONS)
    if extra is not None:
        extra(server)
    ads = AdsServer(cache, on_endpoints_acked, authenticator)
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(ads, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    guarded, port = await serve_guarded(server, listen, budget)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return guarded, ads, port
