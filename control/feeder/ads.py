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
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import grpc
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.route.v3 import route_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from wakegate.control.feeder.cache import SnapshotCache
from wakegate.control.feeder.envoy_types import ENDPOINT, MODEL_ROUTE, ROUTE, WILDCARD_TYPES, pack
from wakegate.control.feeder.h2guard import GRPC_OPTIONS, FrameBudget, GuardedServer, serve_guarded
from wakegate.control.feeder.resources import Resources, resource_digest, version_of
from wakegate.control.feeder.routes import natively_routed
from wakegate.internal_token import Authenticator
from wakegate.v1 import routing_pb2

log = logging.getLogger("wakegate.xds")

_nonces = itertools.count(1)
_eds_versions = itertools.count(1)

#: How long a refused ADS stream is kept open for its first request (see StreamAggregatedResources).
REFUSAL_READ_SECONDS = 1.0


@dataclass
class _Watch:
    names: frozenset[str] = frozenset()
    #: Every resource the client holds of this type as far as this stream told it.
    sent: dict[str, Message] = field(default_factory=dict)
    #: The resources in the last response (for EDS, only the ones that changed).
    last: dict[str, Message] = field(default_factory=dict)
    sent_version: str | None = None
    sent_names: frozenset[str] | None = None
    #: The snapshot's mapping of this type that `sent` was selected from.
    source: Mapping[str, Message] | None = None
    nonce: str = ""
    waiting: bool = False
    acked_version: str = ""


@dataclass
class _DeltaWatch:
    """One delta subscription (extproc's ModelRoutes): what the client holds, by name and version."""

    #: name -> version the client has applied (acknowledged, or said it had when it connected).
    known: dict[str, str] = field(default_factory=dict)
    #: The response awaiting its acknowledgement: nonce, the client's state once it applies it,
    #: the resources it carries and the names it removes.
    pending: tuple[str, dict[str, str], dict[str, Message], tuple[str, ...]] | None = None
    #: name -> the message behind `known` (what the acknowledged state holds).
    held: dict[str, Message] = field(default_factory=dict)
    waiting: bool = True
    #: The snapshot's route mapping last compared against (the same object: nothing to compare).
    source: Mapping[str, Message] | None = None
    #: A response went out on this stream: a client is in sync once it has one, even an empty one.
    answered: bool = False


@dataclass
class StreamStats:
    """Counters a test or the admin endpoint can read."""

    acks: int = 0
    nacks: int = 0
    responses: int = 0
    #: Resources carried by those responses (a delta or an EDS response carries only changes).
    resources_sent: int = 0
    last_nack: str = ""
    nodes: dict[str, int] = field(default_factory=dict)


_R = TypeVar("_R")


class _Inbox(Generic[_R]):
    """A stream's requests, read by one task for good (cancelling a pending read would end the call)."""

    def __init__(self, request_iterator: AsyncIterator[_R]) -> None:
        self._queue: asyncio.Queue[_R | None] = asyncio.Queue()

        async def read() -> None:
            try:
                async for request in request_iterator:
                    await self._queue.put(request)
            finally:
                await self._queue.put(None)

        self._reader = asyncio.create_task(read())

    async def next_or_change(self, cache: SnapshotCache, serial: int) -> tuple[bool, _R | None]:
        """Wait for the next request or a cache newer than `serial`: (True, request or None at the
        stream's end), or (False, None) for a cache change."""
        get = asyncio.ensure_future(self._queue.get())
        change = asyncio.ensure_future(cache.wait_newer(serial))
        done, _ = await asyncio.wait({get, change}, return_when=asyncio.FIRST_COMPLETED)
        if change not in done:
            change.cancel()
        if get not in done:
            get.cancel()
            return False, None
        return True, get.result()

    async def close(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


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

    async def _admit(self, request_iterator: AsyncIterator[object], context: grpc.aio.ServicerContext) -> None:
        """End the stream UNAUTHENTICATED unless it carries the internal token."""
        if self._authenticator is not None and not self._authenticator.allows(context, "ads"):
            # Take the client's first request (waiting at most REFUSAL_READ_SECONDS) before ending
            # the stream: a gRPC Python client whose first write races the refusal sees its own
            # INTERNAL ("Failed execute_batch") instead of UNAUTHENTICATED.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(anext(aiter(request_iterator)), REFUSAL_READ_SECONDS)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid wakegate token")

    def _node_of(
        self, request: discovery_pb2.DiscoveryRequest | discovery_pb2.DeltaDiscoveryRequest, node_id: str, kind: str
    ) -> str:
        """The stream's node id after `request` (the first request names it; later ones may not)."""
        if request.node.id and request.node.id != node_id:
            node_id = request.node.id
            self.stats.nodes[node_id] = self.stats.nodes.get(node_id, 0) + 1
            log.info("xds stream opened node=%s%s", node_id, kind)
        return node_id

    def gateways(self) -> set[str]:
        """Node ids with at least one acknowledgement on record: the gateways that get their own view."""
        return {node for streams in self._acked.values() for node, _ in streams.values()}

    def confirmed(self, node: str) -> Acked | None:
        """cluster -> endpoints every Envoy stream of this node acknowledged; None when it has none."""
        streams = [acked for n, acked in self._acked[ENDPOINT].values() if n == node]
        if not streams:
            return None
        if len(streams) == 1:
            return streams[0]
        clusters = set().union(*(set(a) for a in streams))
        return {c: frozenset.intersection(*(a.get(c, frozenset()) for a in streams)) for c in clusters}

    def retained(self, node: str) -> Acked:
        """cluster -> endpoints some extproc of this node may still pick (it has not acknowledged their removal)."""
        streams = [clusters for n, clusters in self._acked[MODEL_ROUTE].values() if n == node]
        if len(streams) == 1:
            return streams[0]
        out: Acked = dict(streams[0]) if streams else {}
        for clusters in streams[1:]:
            for cluster, endpoints in clusters.items():
                have = out.get(cluster)
                if have is None:
                    out[cluster] = endpoints
                elif not endpoints <= have:
                    out[cluster] = have | endpoints
        return out

    def routed_natively(self, node: str) -> frozenset[str]:
        """Clusters some Envoy of this node may still route to natively (its acknowledged routes)."""
        return frozenset(c for n, clusters in self._acked[ROUTE].values() if n == node for c in clusters)

    async def StreamAggregatedResources(
        self,
        request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        await self._admit(request_iterator, context)
        stream = next(self._streams)
        watches: dict[str, _Watch] = {}
        inbox: _Inbox[discovery_pb2.DiscoveryRequest] = _Inbox(request_iterator)
        node_id = ""
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
                got, request = await inbox.next_or_change(self._cache, serial)
                if not got:
                    continue
                if request is None:
                    return
                node_id = self._node_of(request, node_id, "")
                self._on_request(stream, node_id, request, watches.setdefault(request.type_url, _Watch()))
        finally:
            await inbox.close()
            if node_id:
                log.info("xds stream closed node=%s", node_id)
            removed = [acks.pop(stream, None) for acks in self._acked.values()]
            if any(r is not None for r in removed):
                self._on_endpoints_acked()

    async def DeltaAggregatedResources(
        self,
        request_iterator: AsyncIterator[discovery_pb2.DeltaDiscoveryRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[discovery_pb2.DeltaDiscoveryResponse]:
        """Incremental xDS for extproc's ModelRoutes: each response carries only the routes that
        changed and the names of those removed, so one model's change costs one route on the wire
        and in extproc, however many models there are. Other types are refused (Envoy uses the
        state-of-the-world stream)."""
        await self._admit(request_iterator, context)
        stream = next(self._streams)
        watch: _DeltaWatch | None = None
        inbox: _Inbox[discovery_pb2.DeltaDiscoveryRequest] = _Inbox(request_iterator)
        node_id = ""
        serial = -1
        try:
            while True:
                serial = self._cache.serial
                if watch is not None and watch.waiting:
                    # After an acknowledgement too: a change that came while a response was in
                    # flight is answered now (the route mapping is compared by identity first).
                    response = self._delta_respond(self._cache.view(node_id), watch)
                    if response is not None:
                        yield response
                got, request = await inbox.next_or_change(self._cache, serial)
                if not got:
                    continue
                if request is None:
                    return
                if request.type_url != MODEL_ROUTE:
                    await context.abort(
                        grpc.StatusCode.UNIMPLEMENTED, f"incremental xDS serves {MODEL_ROUTE} only"
                    )
                node_id = self._node_of(request, node_id, " incremental=ModelRoute")
                if watch is None:
                    # What a reconnecting client says it holds: only differences are sent.
                    view = self._cache.view(node_id).by_type.get(MODEL_ROUTE, {})
                    watch = _DeltaWatch(known=dict(request.initial_resource_versions))
                    watch.held = {n: view[n] for n, v in watch.known.items() if n in view and _version(view[n]) == v}
                    if watch.held:
                        self._acked[MODEL_ROUTE][stream] = (node_id, _acked_endpoints(watch.held.values()))
                        self._on_endpoints_acked()
                    continue
                # An acknowledgement; after a NACK the next change is answered from the state the
                # client kept (the rejected routes are offered again only once something changed).
                self._on_delta_request(stream, node_id, request, watch)
        finally:
            await inbox.close()
            if node_id:
                log.info("xds stream closed node=%s incremental=ModelRoute", node_id)
            if self._acked[MODEL_ROUTE].pop(stream, None) is not None:
                self._on_endpoints_acked()

    def _delta_respond(self, view: Resources, watch: _DeltaWatch) -> discovery_pb2.DeltaDiscoveryResponse | None:
        current = view.by_type.get(MODEL_ROUTE, {})
        if current is watch.source:
            return None
        watch.source = current
        known = watch.known
        changed = {}
        for name, message in current.items():
            if watch.held.get(name) is message:
                continue
            version = _version(message)
            if known.get(name) != version:
                changed[name] = (version, message)
        removed = tuple(sorted(name for name in known if name not in current))
        if not changed and not removed and watch.answered:
            return None  # (the first request is always answered, if only to say there is nothing)
        watch.answered = True
        after = dict(known)
        for name in removed:
            del after[name]
        after.update((name, version) for name, (version, _) in changed.items())
        nonce = str(next(_nonces))
        watch.pending = (nonce, after, {name: m for name, (_, m) in changed.items()}, removed)
        watch.waiting = False
        self.stats.responses += 1
        self.stats.resources_sent += len(changed)
        return discovery_pb2.DeltaDiscoveryResponse(
            system_version_info=str(self._cache.serial),
            type_url=MODEL_ROUTE,
            nonce=nonce,
            resources=[
                discovery_pb2.Resource(name=name, version=version, resource=pack(message))
                for name, (version, message) in sorted(changed.items())
            ],
            removed_resources=list(removed),
        )

    def _on_delta_request(
        self, stream: int, node_id: str, request: discovery_pb2.DeltaDiscoveryRequest, watch: _DeltaWatch
    ) -> None:
        """Take an acknowledgement or a NACK of the response in flight."""
        if watch.pending is None or request.response_nonce != watch.pending[0]:
            return  # not an answer to the response in flight
        _, after, carried, removed = watch.pending
        watch.pending = None
        watch.waiting = True
        if request.HasField("error_detail"):
            self.stats.nacks += 1
            self.stats.last_nack = request.error_detail.message
            log.warning("xds delta NACK node=%s type=ModelRoute reason=%s", node_id, request.error_detail.message)
            return
        self.stats.acks += 1
        watch.known = after
        for name in removed:
            watch.held.pop(name, None)
        watch.held.update(carried)
        earlier = self._acked[MODEL_ROUTE].get(stream)
        acked = dict(earlier[1]) if earlier is not None else _acked_endpoints(watch.held.values())
        if earlier is not None:
            acked.update(_acked_endpoints(carried.values()))
        if removed:
            kept = {m.cluster for m in watch.held.values()}  # type: ignore[attr-defined]
            acked = {cluster: endpoints for cluster, endpoints in acked.items() if cluster in kept}
        if earlier != (node_id, acked):
            self._acked[MODEL_ROUTE][stream] = (node_id, acked)
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
        earlier = self._acked[type_url].get(stream)
        if type_url == ENDPOINT:
            # EDS is per name and its responses carry only what changed: names not in this
            # response keep their earlier acknowledgement, names no longer watched are gone.
            acked = dict(earlier[1]) if earlier is not None else {}
            acked.update(_acked_endpoints(watch.last.values()))
            if len(acked) > len(watch.names):
                acked = {name: endpoints for name, endpoints in acked.items() if name in watch.names}
        else:
            acked = _acked_endpoints(watch.sent.values())
        if earlier != (node_id, acked):
            self._acked[type_url][stream] = (node_id, acked)
            self._on_endpoints_acked()

    def _respond(self, view: Resources, type_url: str, watch: _Watch) -> discovery_pb2.DiscoveryResponse | None:
        if not watch.waiting:
            return None
        available = view.by_type.get(type_url)
        if available is not None and available is watch.source and watch.names == watch.sent_names:
            return None  # the very mapping this stream was last sent from: nothing changed
        selected = view.select(type_url, watch.names)
        if type_url not in WILDCARD_TYPES and not watch.names:
            return None  # a named type with nothing named yet: nothing to say
        if type_url == ENDPOINT:
            # State of the world, but EDS responses are incremental: Envoy keeps a cluster's
            # endpoints until a response names that cluster again, so only what changed is sent
            # (and the version counts responses instead of hashing a thousand resources).
            sent = watch.sent
            out = {name: m for name, m in selected.items() if sent.get(name) is not m and _differs(sent.get(name), m)}
            if not out and watch.names == watch.sent_names:
                watch.source = available
                watch.sent = selected
                return None
            version = f"eds-{next(_eds_versions)}"
        else:
            version = version_of(selected)
            if version == watch.sent_version and watch.names == watch.sent_names:
                return None
            out = selected
        watch.nonce = str(next(_nonces))
        watch.source = available
        watch.sent = selected
        watch.last = out
        watch.sent_version = version
        watch.sent_names = watch.names
        watch.waiting = False
        self.stats.responses += 1
        self.stats.resources_sent += len(out)
        return discovery_pb2.DiscoveryResponse(
            version_info=version,
            type_url=type_url,
            nonce=watch.nonce,
            resources=[pack(out[name]) for name in sorted(out)],
        )


def _version(message: Message) -> str:
    """A resource's version in the incremental protocol: its content digest."""
    return resource_digest(message).hex()


def _differs(old: Message | None, new: Message) -> bool:
    return old is None or resource_digest(old) != resource_digest(new)


def _acked_endpoints(messages: Iterable[Message]) -> Acked:
    """cluster -> endpoints, as the acknowledged resources say."""
    acked: Acked = {}
    for message in messages:
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
    return acked


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
