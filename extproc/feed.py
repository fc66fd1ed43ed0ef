"""extproc's xDS client: subscribes to wakegate.v1.ModelRoute over ADS and keeps the route table current.

Pushed, never polled: the feeder sends what changed whenever anything routable
changes (incremental xDS: only the changed routes and the names of removed ones).
Invalid resources are NACKed with the reason and the previous table stays in force.
Reconnects with capped exponential backoff. Every stream carries the internal token (read
again at each connect, so a rotated token is picked up).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.rpc import status_pb2

from wakegate import contract
from wakegate.internal_token import TokenSource
from wakegate.v1 import routing_pb2

log = logging.getLogger("wakegate.extproc.feed")

MODEL_ROUTE = contract.MODEL_ROUTE_TYPE


def decode(response: discovery_pb2.DiscoveryResponse) -> list[routing_pb2.ModelRoute]:
    """The routes of a state-of-the-world response (every route there is)."""
    return [_route(packed) for packed in response.resources]


def _route(packed: Any) -> routing_pb2.ModelRoute:
    route = routing_pb2.ModelRoute()
    if packed.type_url != MODEL_ROUTE or not packed.Unpack(route):
        raise ValueError(f"unexpected resource type {packed.type_url!r}")
    if not route.key or not route.cluster:
        raise ValueError("ModelRoute without key or cluster")
    return route


def decode_delta(
    response: discovery_pb2.DeltaDiscoveryResponse,
) -> tuple[list[tuple[str, routing_pb2.ModelRoute]], list[str]]:
    """The (version, route) pairs an incremental response changes, and the keys it removes."""
    changed = []
    for resource in response.resources:
        route = _route(resource.resource)
        if resource.name != route.key:
            raise ValueError(f"resource {resource.name!r} holds the route of {route.key!r}")
        changed.append((resource.version, route))
    return changed, list(response.removed_resources)


#: Largest route update extproc takes in one message: every route of a very large fleet at once.
MAX_UPDATE_BYTES = 256 * 1024 * 1024


class RouteFeed:
    """Follows the feeder's ModelRoutes over incremental xDS (DeltaAggregatedResources).

    `on_routes(changed, removed)` gets only what changed; the first call after a start has every
    route. After a reconnect the feed tells the feeder which versions it holds, so the feeder
    sends only what changed meanwhile (and removes what went away).
    """

    def __init__(
        self,
        target: str,
        node_id: str,
        on_routes: Callable[[list[routing_pb2.ModelRoute], list[str]], None],
        *,
        token: TokenSource | None = None,
        max_backoff: float = 5.0,
    ) -> None:
        self._token = token
        self._target = target
        self._node = base_pb2.Node(id=node_id, cluster=contract.GATEWAY_NODE_CLUSTER)
        self._on_routes = on_routes
        self._max_backoff = max_backoff
        self.synced = asyncio.Event()
        self.connected = False
        #: route key -> the version this extproc holds.
        self.versions: dict[str, str] = {}

    async def run(self) -> None:
        backoff = 0.1
        options = [("grpc.max_receive_message_length", MAX_UPDATE_BYTES)]
        while True:
            try:
                async with grpc.aio.insecure_channel(self._target, options=options) as channel:
                    await self._stream(ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel))
                backoff = 0.1
            except asyncio.CancelledError:
                raise
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
                # InvalidStateError: the call ended between an update and its ACK.
                log.warning(
                    "route feed disconnected from %s: %s; retrying in %.1fs",
                    self._target,
                    exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else "stream ended",
                    backoff,
                )
            self.connected = False
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._max_backoff)

    async def _stream(self, stub: ads_pb2_grpc.AggregatedDiscoveryServiceStub) -> None:
        # Requests are written on the call itself, not drawn from an async generator: grpc would
        # drain such a generator in a task of its own, which a feeder that vanished leaves pending
        # on the generator (asyncio then logs the task destroyed and the generator's aclose failing).
        metadata = self._token.metadata() if self._token is not None else ()
        call = stub.DeltaAggregatedResources(metadata=metadata)
        try:
            await call.write(
                discovery_pb2.DeltaDiscoveryRequest(
                    node=self._node, type_url=MODEL_ROUTE, initial_resource_versions=self.versions
                )
            )
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    return
                assert isinstance(response, discovery_pb2.DeltaDiscoveryResponse)
                self.connected = True
                await call.write(self._apply(response))
        finally:
            call.cancel()

    def _apply(self, response: discovery_pb2.DeltaDiscoveryResponse) -> discovery_pb2.DeltaDiscoveryRequest:
        """Take one update into the route table; the ACK (or the NACK with the reason) to send."""
        try:
            changed, removed = decode_delta(response)
        except ValueError as exc:
            log.error("route update version=%s rejected: %s", response.system_version_info, exc)
            return discovery_pb2.DeltaDiscoveryRequest(
                node=self._node,
                type_url=MODEL_ROUTE,
                response_nonce=response.nonce,
                error_detail=status_pb2.Status(code=3, message=str(exc)),
            )
        self._on_routes([route for _, route in changed], removed)
        for key in removed:
            self.versions.pop(key, None)
        self.versions.update((route.key, version) for version, route in changed)
        log.log(
            logging.INFO if len(changed) + len(removed) > 10 or not self.synced.is_set() else logging.DEBUG,
            "routes updated version=%s changed=%d removed=%d models=%d",
            response.system_version_info,
            len(changed),
            len(removed),
            len(self.versions),
        )
        self.synced.set()
        return discovery_pb2.DeltaDiscoveryRequest(node=self._node, type_url=MODEL_ROUTE, response_nonce=response.nonce)
