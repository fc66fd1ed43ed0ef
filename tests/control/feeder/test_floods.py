"""PING and SETTINGS floods against the feeder's xDS port (start_server, as `wakegate up`'s
feeder and `wakegate xds` run it), while extproc's real route feed is subscribed to it, and
against the scaler's demand port, which sits behind the same guard.

Each attacker is a process of its own (tests/support/h2attack.py, the same raw HTTP/2 client
the extproc flood tests use) that floods one connection and reports how long the feeder let
it live. What must hold: every attacking connection is closed within a second, and route
changes published meanwhile reach the subscriber.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from tests.control.feeder.test_ads import snapshot
from tests.support import h2attack
from tests.support.scaler import ScalerProcess
from wakegate.control.feeder.ads import start_server
from wakegate.control.feeder.cache import SnapshotCache
from wakegate.control.feeder.h2guard import GuardedServer
from wakegate.extproc.feed import RouteFeed
from wakegate.v1 import demand_pb2, demand_pb2_grpc
from wakegate.v1.routing_pb2 import ModelRoute

#: Attacking connections at once, per attack.
ATTACKERS = 3

_ATTACKER = """
import json, sys, time
from tests.support import h2attack
port, name = int(sys.argv[1]), sys.argv[2]
attack = next(a for a in h2attack.attacks() if a.name == name)
start = time.monotonic()
code, sent, ended = h2attack.one_connection("127.0.0.1", port, attack, h2attack.SIZES[name], start + 20)
print(json.dumps({"seconds": time.monotonic() - start, "frames": sent, "ended": ended}))
"""


async def attack_once(port: int, name: str) -> dict[str, float]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _ATTACKER, str(port), name, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0
    return dict(json.loads(out))


async def subscribe(port: int) -> tuple[list[list[int]], asyncio.Task[None]]:
    """extproc's route feed on the feeder; the endpoint ports of the (one) model's route, each
    time it changes."""
    seen: list[list[int]] = []

    def on_routes(changed: list[ModelRoute], removed: list[str]) -> None:
        seen.extend([e.port for e in route.endpoints] for route in changed)

    feed = RouteFeed(f"127.0.0.1:{port}", "extproc-test", on_routes)
    task = asyncio.create_task(feed.run())
    await asyncio.wait_for(feed.synced.wait(), 5)
    return seen, task


@pytest.fixture
async def feeder() -> AsyncIterator[tuple[SnapshotCache, GuardedServer, int]]:
    cache = SnapshotCache()
    await cache.set(snapshot(9000))
    listener, _, port = await start_server(cache, "127.0.0.1:0")
    yield cache, listener, port
    await listener.stop(0)


@pytest.mark.parametrize("name", ["PING flood", "SETTINGS flood"])
async def test_flood_connections_are_cut_within_a_second_and_routes_keep_flowing(feeder, name: str) -> None:
    cache, listener, port = feeder
    seen, task = await subscribe(port)
    try:
        attackers = asyncio.gather(*(attack_once(port, name) for _ in range(ATTACKERS)))
        # Publish a change every 50 ms while the attackers run; the feed must see each one.
        published = 9000
        while not attackers.done():
            published += 1
            await cache.set(snapshot(9000, published))
            await asyncio.sleep(0.05)
        outcomes = await attackers
        deadline = time.monotonic() + 5
        while seen[-1] != [9000, published] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
    reason = "ping" if name.startswith("PING") else "settings"
    assert listener.guard.stats.cut.get(reason) == ATTACKERS, listener.guard.stats
    for outcome in outcomes:
        assert outcome["ended"] and outcome["seconds"] < 1.0, outcomes
        assert outcome["frames"] < h2attack.SIZES[name], outcomes
    assert seen[-1] == [9000, published], seen[-3:]
    assert len(seen) > 2, "no route change reached the feed during the attack"


async def test_a_well_behaved_client_is_not_cut(feeder) -> None:
    """The feed's own traffic (SETTINGS, its PINGs and ACKs) never trips the budget."""
    cache, listener, port = feeder
    seen, task = await subscribe(port)
    try:
        for extra in range(9001, 9201):
            await cache.set(snapshot(9000, extra))
            await asyncio.sleep(0.005)
        deadline = time.monotonic() + 5
        while seen[-1] != [9000, 9200] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
    assert seen[-1] == [9000, 9200]
    assert listener.guard.stats.cut == {} and listener.guard.stats.connections == 1


@pytest.mark.parametrize("name", ["PING flood", "SETTINGS flood"])
async def test_the_scalers_demand_port_cuts_floods_too(tmp_path: Path, name: str) -> None:
    """`wakegate scaler --demand-listen`, which gateways reach over the network, has the same guard."""
    scaler = await asyncio.to_thread(ScalerProcess, tmp_path)
    try:
        port = int(scaler.demand.rsplit(":", 1)[1])
        outcomes = await asyncio.gather(*(attack_once(port, name) for _ in range(ATTACKERS)))
        async with grpc.aio.insecure_channel(scaler.demand) as channel:
            report = demand_pb2.DemandReport(gateway_id="gw", instance="i", sequence=1)
            reply = await demand_pb2_grpc.DemandServiceStub(channel).Report(
                report, metadata=(("authorization", "Bearer s3cret-token"),)
            )
    finally:
        assert await asyncio.to_thread(scaler.stop) == 0, scaler.log()
    for outcome in outcomes:
        assert outcome["ended"] and outcome["seconds"] < 1.0, outcomes
    assert reply.accepted, reply
    assert scaler.log().count("over budget") == ATTACKERS, scaler.log()


async def test_stopping_the_guard_with_connections_open_logs_no_error(caplog: pytest.LogCaptureFixture) -> None:
    """The feeder stopping while Envoy and the extprocs are subscribed: the guard ends their
    connections without asyncio logging an error for each (it did: "Exception in callback",
    a cancelled connection task, on every feeder stop in the fault tests' logs)."""
    cache = SnapshotCache()
    await cache.set(snapshot(9000))
    server, _, port = await start_server(cache, "127.0.0.1:0")
    _, subscription = await subscribe(port)
    await asyncio.sleep(0.3)
    await server.stop(None)
    subscription.cancel()
    await asyncio.gather(subscription, return_exceptions=True)
    await asyncio.sleep(0.1)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
