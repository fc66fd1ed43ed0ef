"""The ADS server and extproc's route feed, over real gRPC on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.rpc import status_pb2

from wakegate.control.feeder import resources as r
from wakegate.control.feeder.ads import start_server
from wakegate.control.feeder.cache import SnapshotCache
from wakegate.extproc.feed import RouteFeed

NODE = base_pb2.Node(id="test-envoy")


def snapshot(*ports: int) -> r.Resources:
    model = r.RoutedModel(key="m", names=("m",), served_name="m", endpoints=tuple(("127.0.0.1", p) for p in ports))
    return r.build([model], r.GatewaySettings())


class Client:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.outgoing: asyncio.Queue[discovery_pb2.DiscoveryRequest] = asyncio.Queue()

        async def requests() -> AsyncIterator[discovery_pb2.DiscoveryRequest]:
            while True:
                yield await self.outgoing.get()

        self.call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(requests())
        self.incoming: asyncio.Queue[discovery_pb2.DiscoveryResponse] = asyncio.Queue()
        # Cancelling a pending read would cancel the whole call, so one task reads for good.
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for response in self.call:
            await self.incoming.put(response)

    async def send(self, **fields: object) -> None:
        await self.outgoing.put(discovery_pb2.DiscoveryRequest(node=NODE, **fields))  # type: ignore[arg-type]

    async def receive(self, timeout: float = 2.0) -> discovery_pb2.DiscoveryResponse:
        return await asyncio.wait_for(self.incoming.get(), timeout)


@pytest.fixture
async def server() -> AsyncIterator[tuple[SnapshotCache, grpc.aio.Channel, object]]:
    cache = SnapshotCache()
    await cache.set(snapshot(9000))
    srv, ads, port = await start_server(cache, "127.0.0.1:0")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    channel.target = f"127.0.0.1:{port}"  # type: ignore[attr-defined]
    yield cache, channel, ads
    await channel.close()
    await srv.stop(0)


async def test_nack_is_logged_and_does_not_wedge_the_stream(server, caplog: pytest.LogCaptureFixture) -> None:
    cache, channel, ads = server
    client = Client(channel)
    await client.send(type_url=r.CLUSTER)
    first = await client.receive()
    assert len(first.resources) == 1
    await client.send(
        type_url=r.CLUSTER,
        response_nonce=first.nonce,
        version_info="",
        error_detail=status_pb2.Status(code=3, message="bad cluster: reason from envoy"),
    )
    with pytest.raises(TimeoutError):
        await client.receive(timeout=0.3)  # the same version is not re-sent after a NACK
    assert "reason from envoy" in caplog.text
    assert ads.stats.nacks == 1
    await cache.set(
        r.build(
            [
                r.RoutedModel(key="m", names=("m",), served_name="m"),
                r.RoutedModel(key="n", names=("n",), served_name="n"),
            ],
            r.GatewaySettings(),
        )
    )
    second = await client.receive()
    assert len(second.resources) == 2 and second.version_info != first.version_info
    await client.send(type_url=r.CLUSTER, response_nonce=second.nonce, version_info=second.version_info)
    await asyncio.sleep(0.1)
    assert ads.stats.acks == 1


async def test_named_endpoints_are_pushed_only_on_change(server) -> None:
    cache, channel, _ = server
    client = Client(channel)
    await client.send(type_url=r.ENDPOINT, resource_names=["model.m"])
    first = await client.receive()
    await client.send(
        type_url=r.ENDPOINT, resource_names=["model.m"], response_nonce=first.nonce, version_info=first.version_info
    )
    await cache.set(snapshot(9000))  # same content: nothing to push
    with pytest.raises(TimeoutError):
        await client.receive(timeout=0.3)
    await cache.set(snapshot(9000, 9001))
    second = await client.receive()
    cla = r.endpoint_pb2.ClusterLoadAssignment()
    second.resources[0].Unpack(cla)
    assert len(cla.endpoints[0].lb_endpoints) == 2


async def test_route_feed_receives_pushes(server) -> None:
    cache, channel, _ = server
    target = channel.target
    seen: list[list[int]] = []
    feed = RouteFeed(target, "extproc-test", lambda routes: seen.append([e.port for e in routes[0].endpoints]))
    task = asyncio.create_task(feed.run())
    try:
        await asyncio.wait_for(feed.synced.wait(), 2)
        await cache.set(snapshot(9000, 9005))
        for _ in range(100):
            if seen[-1] == [9000, 9005]:
                break
            await asyncio.sleep(0.01)
        assert seen == [[9000], [9000, 9005]]
    finally:
        task.cancel()
