"""The ADS server and extproc's route feed, over real gRPC on loopback."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.route.v3 import route_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.rpc import status_pb2

from wakegate.control.feeder import resources as r
from wakegate.control.feeder.ads import AdsServer, start_server
from wakegate.control.feeder.cache import SnapshotCache
from wakegate.control.feeder.clusters import load_assignment
from wakegate.control.feeder.envoy_types import CLUSTER, ENDPOINT, MODEL_ROUTE, ROUTE, ROUTE_NAME
from wakegate.control.feeder.publisher import Publisher
from wakegate.control.feeder.routed import RoutedModel
from wakegate.control.feeder.routes import natively_routed
from wakegate.control.feeder.settings import GatewaySettings
from wakegate.extproc.feed import RouteFeed
from wakegate.v1 import routing_pb2

NODE = base_pb2.Node(id="test-envoy")


def snapshot(*ports: int) -> r.Resources:
    model = RoutedModel(key="m", names=("m",), served_name="m", endpoints=tuple(("127.0.0.1", p) for p in ports))
    return r.build([model], GatewaySettings())


class Client:
    def __init__(
        self, channel: grpc.aio.Channel, node: base_pb2.Node = NODE, metadata: tuple[tuple[str, str], ...] = ()
    ) -> None:
        self.node = node
        self.outgoing: asyncio.Queue[discovery_pb2.DiscoveryRequest] = asyncio.Queue()

        async def requests() -> AsyncIterator[discovery_pb2.DiscoveryRequest]:
            while True:
                yield await self.outgoing.get()

        self.call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(
            requests(), metadata=metadata
        )
        self.incoming: asyncio.Queue[discovery_pb2.DiscoveryResponse] = asyncio.Queue()
        # Cancelling a pending read would cancel the whole call, so one task reads for good.
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for response in self.call:
            await self.incoming.put(response)

    async def send(self, **fields: object) -> None:
        await self.outgoing.put(discovery_pb2.DiscoveryRequest(node=self.node, **fields))  # type: ignore[arg-type]

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
    await client.send(type_url=CLUSTER)
    first = await client.receive()
    assert len(first.resources) == 1
    await client.send(
        type_url=CLUSTER,
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
                RoutedModel(key="m", names=("m",), served_name="m"),
                RoutedModel(key="n", names=("n",), served_name="n"),
            ],
            GatewaySettings(),
        )
    )
    second = await client.receive()
    assert len(second.resources) == 2 and second.version_info != first.version_info
    await client.send(type_url=CLUSTER, response_nonce=second.nonce, version_info=second.version_info)
    await asyncio.sleep(0.1)
    assert ads.stats.acks == 1


async def test_named_endpoints_are_pushed_only_on_change(server) -> None:
    cache, channel, _ = server
    client = Client(channel)
    await client.send(type_url=ENDPOINT, resource_names=["model.m"])
    first = await client.receive()
    await client.send(
        type_url=ENDPOINT, resource_names=["model.m"], response_nonce=first.nonce, version_info=first.version_info
    )
    await cache.set(snapshot(9000))  # same content: nothing to push
    with pytest.raises(TimeoutError):
        await client.receive(timeout=0.3)
    await cache.set(snapshot(9000, 9001))
    second = await client.receive()
    cla = endpoint_pb2.ClusterLoadAssignment()
    second.resources[0].Unpack(cla)
    assert len(cla.endpoints[0].lb_endpoints) == 2


async def test_route_feed_receives_pushes(server) -> None:
    cache, channel, _ = server
    target = channel.target
    seen: list[list[int]] = []
    feed = RouteFeed(target, "extproc-test", lambda routes, _: seen.append([e.port for e in routes[0].endpoints]))
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


def fleet(n: int, ready: dict[int, tuple[int, ...]] | None = None) -> list[RoutedModel]:
    return [
        RoutedModel(
            key=f"m{i}",
            names=(f"m{i}",),
            served_name=f"m{i}",
            endpoints=tuple(("127.0.0.1", p) for p in (ready or {}).get(i, ())),
        )
        for i in range(n)
    ]


async def wait_until(check: object, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_the_route_feed_gets_only_what_changed_and_only_differences_after_a_reconnect(server) -> None:
    cache, channel, ads = server
    memo = r.BuildMemo()
    await cache.set(r.build(fleet(300), GatewaySettings(), memo=memo))
    updates: list[tuple[list[str], list[str]]] = []
    feed = RouteFeed(channel.target, "extproc-test", lambda c, gone: updates.append(([x.key for x in c], gone)))
    task = asyncio.create_task(feed.run())
    try:
        await asyncio.wait_for(feed.synced.wait(), 3)
        assert len(updates[0][0]) == 300 and updates[0][1] == []

        # One replica ready: one route crosses, not 300.
        sent = ads.stats.resources_sent
        await cache.set(r.build(fleet(300, {7: (9007,)}), GatewaySettings(), memo=memo))
        await wait_until(lambda: len(updates) == 2)
        assert updates[1] == (["m7"], []) and ads.stats.resources_sent == sent + 1

        # A model removed: its name alone.
        await cache.set(r.build(fleet(300, {7: (9007,)})[:299], GatewaySettings(), memo=memo))
        await wait_until(lambda: len(updates) == 3)
        assert updates[2] == ([], ["m299"]) and len(feed.versions) == 299

        # The feed reconnects (the feeder restarted, say) while two models changed: it says
        # what it holds and gets just those two.
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await cache.set(r.build(fleet(299, {7: (9007,), 8: (9008,)})[1:], GatewaySettings(), memo=memo))
        task = asyncio.create_task(feed.run())
        await wait_until(lambda: len(updates) == 4)
        assert updates[3] == (["m8"], ["m0"])
        assert sorted(feed.versions) == sorted(f"m{i}" for i in range(1, 299))
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_route_update_extproc_refuses_is_nacked_and_offered_again_on_the_next_change(
    server, caplog: pytest.LogCaptureFixture
) -> None:
    cache, channel, ads = server
    memo = r.BuildMemo()
    await cache.set(r.build(fleet(3), GatewaySettings(), memo=memo))
    updates: list[list[str]] = []
    feed = RouteFeed(channel.target, "extproc-test", lambda c, _: updates.append([x.key for x in c]))
    task = asyncio.create_task(feed.run())
    try:
        await asyncio.wait_for(feed.synced.wait(), 3)
        broken = r.build(fleet(3, {1: (9001,)}), GatewaySettings(), memo=memo)
        routes = dict(broken.by_type[MODEL_ROUTE])
        routes["m1"] = routing_pb2.ModelRoute(key="m1")  # no cluster: extproc refuses it
        await cache.set(r.Resources(by_type={**broken.by_type, MODEL_ROUTE: routes}))
        await wait_until(lambda: ads.stats.nacks == 1)
        assert "ModelRoute without key or cluster" in caplog.text and len(updates) == 1
        await cache.set(r.build(fleet(3, {1: (9001,), 2: (9002,)}), GatewaySettings(), memo=memo))
        await wait_until(lambda: len(updates) == 2)
        assert sorted(updates[1]) == ["m1", "m2"]  # the refused one again, with the new change
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_an_endpoint_change_sends_envoy_that_cluster_alone(server) -> None:
    cache, channel, _ = server
    memo = r.BuildMemo()
    await cache.set(r.build(fleet(50), GatewaySettings(), memo=memo))
    client = Client(channel)
    names = [f"model.m{i}" for i in range(50)]
    await client.send(type_url=ENDPOINT, resource_names=names)
    first = await client.receive()
    assert len(first.resources) == 50
    await client.send(
        type_url=ENDPOINT, resource_names=names, response_nonce=first.nonce, version_info=first.version_info
    )
    await cache.set(r.build(fleet(50, {3: (9003,)}), GatewaySettings(), memo=memo))
    second = await client.receive()
    cla = endpoint_pb2.ClusterLoadAssignment()
    (packed,) = second.resources
    packed.Unpack(cla)
    assert cla.cluster_name == "model.m3" and len(cla.endpoints[0].lb_endpoints) == 1
    assert memo.rebuilt == 1


class Gateway:
    """One node's two subscriptions over real gRPC: its Envoy's EDS and its extproc's ModelRoutes."""

    def __init__(self, channel: grpc.aio.Channel, node: str) -> None:
        self.envoy = Client(channel, base_pb2.Node(id=node))
        self.extproc = Client(channel, base_pb2.Node(id=node))

    async def send(self, client: Client, **fields: object) -> None:
        await client.send(**fields)

    async def ack(self, client: Client, response: discovery_pb2.DiscoveryResponse) -> None:
        names = ["model.m"] if response.type_url == ENDPOINT else []
        await client.send(
            type_url=response.type_url,
            resource_names=names,
            response_nonce=response.nonce,
            version_info=response.version_info,
        )


def route_ports(response: discovery_pb2.DiscoveryResponse) -> list[int]:
    route = routing_pb2.ModelRoute()
    response.resources[0].Unpack(route)
    return [e.port for e in route.endpoints]


def eds_ports(response: discovery_pb2.DiscoveryResponse) -> list[int]:
    cla = endpoint_pb2.ClusterLoadAssignment()
    response.resources[0].Unpack(cla)
    return [lb.endpoint.address.socket_address.port_value for lb in cla.endpoints[0].lb_endpoints]


async def test_each_gateway_is_gated_by_its_own_envoy_only() -> None:
    models = [RoutedModel(key="m", names=("m",), served_name="m", endpoints=(("127.0.0.1", 9000),))]
    publisher = Publisher(SnapshotCache(), GatewaySettings(), lambda: models)
    await publisher.publish()
    srv, publisher.ads, port = await start_server(
        publisher.cache, "127.0.0.1:0", on_endpoints_acked=publisher.publish_soon
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            a, b = Gateway(channel, "gw-a"), Gateway(channel, "gw-b")
            for gw in (a, b):
                await gw.send(gw.envoy, type_url=ENDPOINT, resource_names=["model.m"])
                eds = await gw.envoy.receive()
                assert eds_ports(eds) == [9000]
                await gw.ack(gw.envoy, eds)
                await gw.send(gw.extproc, type_url=MODEL_ROUTE)
                route = await gw.extproc.receive()
                assert route_ports(route) == [9000]
                await gw.ack(gw.extproc, route)
            # A new endpoint: both Envoys are told; only gw-a's Envoy acknowledges (gw-b hangs).
            models[0] = replace(models[0], endpoints=(("127.0.0.1", 9000), ("127.0.0.1", 9001)))
            publisher.publish_soon()
            eds_a, eds_b = await a.envoy.receive(), await b.envoy.receive()
            assert eds_ports(eds_a) == eds_ports(eds_b) == [9000, 9001]
            await a.ack(a.envoy, eds_a)
            # gw-a's extproc gets it on its own Envoy's word; gw-b's waits for gw-b's Envoy.
            route_a = await a.extproc.receive()
            assert route_ports(route_a) == [9000, 9001]
            await a.ack(a.extproc, route_a)
            with pytest.raises(TimeoutError):
                await b.extproc.receive(timeout=0.5)
            # gw-b's Envoy rejects it: gw-b stays where it was, gw-a is untouched.
            await b.send(
                b.envoy,
                type_url=ENDPOINT,
                resource_names=["model.m"],
                response_nonce=eds_b.nonce,
                error_detail=status_pb2.Status(code=3, message="no"),
            )
            with pytest.raises(TimeoutError):
                await b.extproc.receive(timeout=0.5)
            # The old endpoint goes: gw-b's extproc, which still holds it, keeps it in gw-b's Envoy
            # only; gw-a's extproc dropped it... once it acknowledges, and gw-a's Envoy follows.
            models[0] = replace(models[0], endpoints=(("127.0.0.1", 9001),))
            publisher.publish_soon()
            route_a = await a.extproc.receive()
            assert route_ports(route_a) == [9001]
            with pytest.raises(TimeoutError):
                await a.envoy.receive(timeout=0.3)  # gw-a's extproc has not acknowledged the removal yet
            await a.ack(a.extproc, route_a)
            assert eds_ports(await a.envoy.receive()) == [9001]
            assert publisher.ads is not None
            assert publisher.ads.retained("gw-b") == {"model.m": frozenset({("127.0.0.1", 9000)})}
            assert publisher.cache.view("gw-b").by_type[ENDPOINT]["model.m"] == load_assignment(
                replace(models[0], endpoints=(("127.0.0.1", 9000), ("127.0.0.1", 9001)))
            )
            # A node never seen gets the ungated base.
            assert publisher.cache.view("nobody") is publisher.cache.snapshot
            for client in (a.envoy, a.extproc, b.envoy, b.extproc):
                client.call.cancel()
    finally:
        await srv.stop(0)
    # Each stream's handler forgets its gateway as it unwinds, which may be just after stop().
    deadline = time.monotonic() + 5
    while publisher.ads.gateways() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert publisher.ads.gateways() == set(), "closed streams leave no record"


async def test_a_native_models_last_endpoint_leaves_only_after_envoy_acked_routes_without_it() -> None:
    """Over real gRPC: the model goes cold; its Envoy first gets routes without the native ones
    while its cluster keeps the endpoint, and only the ACK of those routes empties the cluster."""
    ep = ("127.0.0.1", 9000)
    models = [
        RoutedModel(key="m", names=("m",), served_name="m", strategy="round-robin", path="native", endpoints=(ep,))
    ]
    settings = GatewaySettings(native_allowed=True)
    publisher = Publisher(SnapshotCache(), settings, lambda: models)
    await publisher.publish()
    srv, publisher.ads, port = await start_server(
        publisher.cache, "127.0.0.1:0", on_endpoints_acked=publisher.publish_soon
    )
    names = {ENDPOINT: ["model.m"], ROUTE: [ROUTE_NAME]}

    def native(response: discovery_pb2.DiscoveryResponse) -> frozenset[str]:
        config = route_pb2.RouteConfiguration()
        response.resources[0].Unpack(config)
        return natively_routed(config)

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            envoy = Client(channel, base_pb2.Node(id="gw"))

            async def ack(response: discovery_pb2.DiscoveryResponse) -> None:
                await envoy.send(
                    type_url=response.type_url,
                    resource_names=names[response.type_url],
                    response_nonce=response.nonce,
                    version_info=response.version_info,
                )

            async def next_of(type_url: str) -> discovery_pb2.DiscoveryResponse:
                while True:
                    response = await envoy.receive()
                    if response.type_url == type_url:
                        return response

            await envoy.send(type_url=ENDPOINT, resource_names=names[ENDPOINT])
            eds = await next_of(ENDPOINT)
            await ack(eds)
            await envoy.send(type_url=ROUTE, resource_names=names[ROUTE])
            rds = await next_of(ROUTE)
            assert native(rds) == {"model.m"}
            await ack(rds)
            for _ in range(100):
                if publisher.ads.routed_natively("gw") == {"model.m"}:
                    break
                await asyncio.sleep(0.01)
            assert publisher.ads.routed_natively("gw") == {"model.m"}
            # Cold: routes without the native ones first; the endpoint stays in the cluster.
            models[0] = replace(models[0], endpoints=())
            publisher.publish_soon()
            rds = await next_of(ROUTE)
            assert native(rds) == frozenset()
            view = publisher.cache.view("gw").by_type[ENDPOINT]["model.m"]
            assert [lb.endpoint.address.socket_address.port_value for lb in view.endpoints[0].lb_endpoints] == [9000]  # type: ignore[attr-defined]
            # Envoy applies them: now the cluster empties.
            await ack(rds)
            eds = await next_of(ENDPOINT)
            cla = endpoint_pb2.ClusterLoadAssignment()
            eds.resources[0].Unpack(cla)
            assert [lb for locality in cla.endpoints for lb in locality.lb_endpoints] == []
            envoy.call.cancel()
    finally:
        await srv.stop(0)


async def test_the_route_feed_is_in_sync_with_an_empty_route_set(server) -> None:
    """A gateway in front of a cluster with no Models yet: extproc still hears that there is
    nothing (its readiness waits for a first route table), then gets the first Model."""
    cache, channel, _ = server
    await cache.set(r.build([], GatewaySettings()))
    updates: list[tuple[list[str], list[str]]] = []
    feed = RouteFeed(channel.target, "extproc-test", lambda c, gone: updates.append(([x.key for x in c], gone)))
    task = asyncio.create_task(feed.run())
    try:
        await asyncio.wait_for(feed.synced.wait(), 3)
        assert updates == [([], [])]
        await cache.set(r.build(fleet(1), GatewaySettings()))
        await wait_until(lambda: len(updates) == 2)
        assert updates[1] == (["m0"], [])
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _bare_ads(cache: SnapshotCache, port: int = 0) -> tuple[grpc.aio.Server, int]:
    """The ADS service on a plain grpc.aio server (the feeder's frame guard has tasks of its own,
    whose end would be logged as the server's, not the feed's)."""
    srv = grpc.aio.server()
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(AdsServer(cache, lambda: None, None), srv)
    port = srv.add_insecure_port(f"127.0.0.1:{port}")
    await srv.start()
    return srv, port


async def test_the_route_feed_outlives_a_feeder_that_vanished_without_an_asyncio_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A feeder gone mid-stream (here: its server stopped at once, several times over) costs the
    feed a reconnect, and asyncio has nothing to complain about (no task left pending on the
    stream, no generator closed while it runs)."""
    cache = SnapshotCache()
    await cache.set(snapshot(9000))
    srv, port = await _bare_ads(cache)
    feed = RouteFeed(f"127.0.0.1:{port}", "extproc-test", lambda c, _: None, max_backoff=0.1)
    task = asyncio.create_task(feed.run())
    try:
        for round_ in range(5):
            await asyncio.wait_for(feed.synced.wait(), 5)
            await srv.stop(None)
            feed.synced.clear()
            gc.collect()
            await asyncio.sleep(0.05)
            srv, _ = await _bare_ads(cache, port)
            await cache.set(snapshot(9000 + round_ + 1))
        await asyncio.wait_for(feed.synced.wait(), 5)
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await srv.stop(None)
    gc.collect()
    await asyncio.sleep(0.05)
    assert [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.ERROR] == []
