"""extproc's count of its Envoy's native requests (`--envoy-admin`), against an admin API on loopback.

The stand-in answers `/stats?format=json` with the counters the test sets, as Envoy's admin API
does; the real Envoy and the scaler are in e2e/test_native.py.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from wakegate.extproc import main
from wakegate.extproc.auth import ALL_MODELS, ApiKeys
from wakegate.extproc.gateway import Gateway, Settings
from wakegate.extproc.native import STALE_SECONDS, NativeCounts
from wakegate.v1 import routing_pb2


class Admin:
    """Envoy's admin API as far as the poll reads it: the model clusters' two counters."""

    def __init__(self) -> None:
        self.counters: dict[str, tuple[int, int]] = {}
        self.up = True
        self.queries: list[str] = []
        self.address = ""

    def session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(base_url=f"http://{self.address}")

    async def stats(self, request: web.Request) -> web.Response:
        self.queries.append(request.query.get("filter", ""))
        if not self.up:
            return web.Response(status=503, text="no")
        entries: list[dict[str, Any]] = []
        for name, (active, total) in self.counters.items():
            entries.append({"name": f"cluster.{name}.upstream_rq_active", "value": active})
            entries.append({"name": f"cluster.{name}.upstream_rq_total", "value": total})
        return web.json_response({"stats": entries})


@pytest.fixture
def gw() -> Gateway:
    """A gateway routing one model that asks for the native path and one that does not."""
    gateway = Gateway(Settings(), ApiKeys(None))
    gateway.set_routes(
        [
            routing_pb2.ModelRoute(key="ns/n", names=["n"], served_name="n", cluster="model.ns.n", path="native"),
            routing_pb2.ModelRoute(key="ns/d", names=["d"], served_name="d", cluster="model.ns.d", path="decided"),
        ]
    )
    return gateway


@pytest.fixture
def counts(fake: Admin, gw: Gateway) -> NativeCounts:
    return NativeCounts(fake.address, gw)


@pytest.fixture
async def fake() -> AsyncIterator[Admin]:
    admin = Admin()
    app = web.Application()
    app.router.add_get("/stats", admin.stats)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    admin.address = f"127.0.0.1:{runner.addresses[0][1]}"
    yield admin
    await runner.cleanup()


async def test_only_what_exceeds_extprocs_own_requests_is_native_and_joins_the_report(
    fake: Admin, gw: Gateway, counts: NativeCounts
) -> None:
    gw.in_flight.update({"ns/n": 1, "ns/d": 2})
    changes: list[dict[str, int]] = []
    counts.on_change = lambda: changes.append(dict(counts.in_flight))
    fake.counters = {"model_ns_n": (3, 10), "model_ns_d": (4, 9)}  # d's extra 2 are not native: d is decided
    async with fake.session() as session:
        await counts.poll(session, 0.0)
        assert counts.in_flight == {"ns/n": 2}
        assert counts.reported() == {"ns/n": 3, "ns/d": 2}
        assert gw.in_flight == {"ns/n": 1, "ns/d": 2}  # extproc's own book is left alone
        await counts.poll(session, 0.25)  # the same counts: no change to report
        assert changes == [{"ns/n": 2}]
        # Requests that came and went between two polls still count for that interval.
        gw.in_flight.clear()
        fake.counters = {"model_ns_n": (0, 14)}
        await counts.poll(session, 0.5)
        assert counts.in_flight == {"ns/n": 1}
        await counts.poll(session, 0.75)
        assert counts.in_flight == {} and counts.reported() == {}
    assert changes == [{"ns/n": 2}, {"ns/n": 1}, {}]
    assert fake.queries[0] == r"^cluster\.model_[^.]+\.upstream_rq_(active|total)$"  # nothing else is read


async def test_the_status_and_queue_views_count_native_requests_too(
    fake: Admin, gw: Gateway, counts: NativeCounts
) -> None:
    """A federation's global gateway picks members by the in-flight their status says."""
    gw.in_flight["ns/n"] = 1
    fake.counters = {"model_ns_n": (4, 8)}
    async with fake.session() as session:
        await counts.poll(session, 0.0)
    status = {m["model"]: m["in_flight"] for m in json.loads(gw.status_body_for(ALL_MODELS))["models"]}
    assert status == {"n": 4, "d": 0}
    queue = {m["model"]: m["in_flight"] for m in gw.queue_view()["models"]}
    assert queue == {"ns/n": 4, "ns/d": 0}
    assert gw.in_flight == {"ns/n": 1}


async def test_no_native_model_no_poll(fake: Admin, gw: Gateway, counts: NativeCounts) -> None:
    gw.set_routes([routing_pb2.ModelRoute(key="ns/d", names=["d"], served_name="d", cluster="model.ns.d")])
    async with fake.session() as session:
        await counts.poll(session, 0.0)
    assert fake.queries == []


async def test_a_model_that_left_the_native_path_is_counted_until_its_requests_end(
    fake: Admin, gw: Gateway, counts: NativeCounts
) -> None:
    fake.counters = {"model_ns_n": (2, 5)}
    async with fake.session() as session:
        await counts.poll(session, 0.0)
        gw.set_routes([])  # the Model was deleted, or turned decided, while Envoy still serves two
        await counts.poll(session, 0.25)
        assert counts.in_flight == {"ns/n": 2}
        fake.counters = {"model_ns_n": (0, 5)}
        await counts.poll(session, 0.5)
        assert counts.in_flight == {}
        queries = len(fake.queries)
        await counts.poll(session, 0.75)
        assert len(fake.queries) == queries  # nothing left to count


async def test_an_unanswering_envoy_keeps_the_last_count_then_drops_it_saying_so_once(
    fake: Admin, counts: NativeCounts, caplog: pytest.LogCaptureFixture
) -> None:
    fake.counters = {"model_ns_n": (5, 50)}
    async with fake.session() as session:
        await counts.poll(session, 100.0)
        fake.up = False
        with caplog.at_level(logging.INFO, logger="wakegate.extproc.native"):
            await counts.poll(session, 101.0)
            await counts.poll(session, 102.0)
            assert counts.in_flight == {"ns/n": 5}
            await counts.poll(session, 100.0 + STALE_SECONDS + 1)
            assert counts.in_flight == {}  # a dead Envoy's requests do not keep the model up
            fake.up = True
            await counts.poll(session, 120.0)
            assert counts.in_flight == {"ns/n": 5}
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "unanswered" in messages[0] and "answers again" in messages[1], messages
    assert "Traceback" not in caplog.text


def test_envoy_admin_must_be_host_port() -> None:
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    args = parser.parse_args(["--xds", "x:1", "--envoy-admin", "127.0.0.1:9901"])
    assert main.Settings.from_args(args).envoy_admin == "127.0.0.1:9901"
    assert main.Settings.from_args(parser.parse_args(["--xds", "x:1"])).envoy_admin is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--xds", "x:1", "--envoy-admin", "9901"])
