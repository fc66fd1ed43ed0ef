"""extproc's xDS client: subscribes to wakegate.v1.ModelRoute over ADS and keeps the route table current.

Pushed, never polled: the feeder sends a new set whenever anything routable
changes. Invalid resources are NACKed with the reason and the previous table
stays in force. Reconnects with capped exponential backoff. Every stream carries the
internal token (read again at each connect, so a rotated token is picked up).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

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
    routes = []
    for packed in response.resources:
        route = routing_pb2.ModelRoute()
        if packed.type_url != MODEL_ROUTE or not packed.Unpack(route):
            raise ValueError(f"unexpected resource type {packed.type_url!r}")
        if not route.key or not route.cluster:
            raise ValueError("ModelRoute without key or cluster")
        routes.append(route)
    return routes


class RouteFeed:
    def __init__(
        self,
        target: str,
        node_id: str,
        on_routes: Callable[[list[routing_pb2.ModelRoute]], None],
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

    async def run(self) -> None:
        backoff = 0.1
        while True:
            try:
                async with grpc.aio.insecure_channel(self._target) as channel:
                    await self._stream(ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel))
                backoff = 0.1
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "route feed disconnected from %s: %s; retrying in %.1fs",
                    self._target,
                    exc.code().name,
                    backoff,
                )
            self.connected = False
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._max_backoff)

    async def _stream(self, stub: ads_pb2_grpc.AggregatedDiscoveryServiceStub) -> None:
        outgoing: asyncio.Queue[discovery_pb2.DiscoveryRequest] = asyncio.Queue()
        await outgoing.put(discovery_pb2.DiscoveryRequest(node=self._node, type_url=MODEL_ROUTE))

        async def requests() -> AsyncIterator[discovery_pb2.DiscoveryRequest]:
            while True:
                yield await outgoing.get()

        metadata = self._token.metadata() if self._token is not None else ()
        call = stub.StreamAggregatedResources(requests(), metadata=metadata)
        version = ""
        async for response in call:
            self.connected = True
            try:
                routes = decode(response)
            except ValueError as exc:
                log.error("route update version=%s rejected: %s", response.version_info, exc)
                await outgoing.put(
                    discovery_pb2.DiscoveryRequest(
                        node=self._node,
                        type_url=MODEL_ROUTE,
                        version_info=version,
                        response_nonce=response.nonce,
                        error_detail=status_pb2.Status(code=3, message=str(exc)),
                    )
                )
                continue
            self._on_routes(routes)
            version = response.version_info
            log.info("routes updated version=%s models=%d", version, len(routes))
            self.synced.set()
            await outgoing.put(
                discovery_pb2.DiscoveryRequest(
                    node=self._node, type_url=MODEL_ROUTE, version_info=version, response_nonce=response.nonce
                )
            )
