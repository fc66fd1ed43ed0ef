"""Hot swap of LoRA adapters on engines that load them at run time, against real sim processes
with vLLM's adapter API: the per-replica cap with LRU, adapters in use never unloaded, idle ones
unloaded, failures kept with the engine's reason; on a fleet, affinity picking keeps the loads
well below random placement; `up`'s choice of replica and the demand book's adapter sums."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.bench.bench_lora import run_policy, workload
from tests.support.sim import SimFactory, SimProcess, start_sim
from tests.support.up import adapter_doc, model_doc
from wakegate.control.delivery.resolver import Access
from wakegate.control.demand.book import AdapterLoad, DemandBook
from wakegate.control.feeder.routed import routed_adapters
from wakegate.control.manifests import parse_models
from wakegate.control.up import hotswap
from wakegate.control.up.adapters import AdapterError, AdapterLoader, AdapterSlots
from wakegate.control.up.hotswap import HotSwap, choose
from wakegate.control.up.weights import Delivery, DeliveryConfig
from wakegate.v1 import demand_pb2


@pytest.fixture
def sim_factory() -> Iterator[SimFactory]:
    started: list[SimProcess] = []

    def factory(*args: str) -> SimProcess:
        started.append(start_sim(0, *args))
        return started[-1]

    yield factory
    for sim in started:
        sim.stop(timeout=5)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def loaded(session: aiohttp.ClientSession, url: str) -> set[str]:
    async with session.get(f"{url}/v1/models") as resp:
        return {m["id"] for m in (await resp.json())["data"] if m.get("parent")}


async def test_lru_cap_pins_and_idle_unloads_on_a_real_engine(sim_factory: SimFactory) -> None:
    sim = sim_factory("--served-model-name", "base", "--enable-lora", "--max-loras", "2")
    ep = f"127.0.0.1:{sim.port}"
    clock = Clock()
    loader = AdapterLoader(cap=2, clock=clock)
    async with aiohttp.ClientSession() as s:
        assert await loader.ensure(s, ep, "a", "/w/a") is True
        loader.release(ep, "a")
        clock.now = 1
        assert await loader.ensure(s, ep, "b", "/w/b") is True
        loader.release(ep, "b")
        clock.now = 2
        assert await loader.ensure(s, ep, "a", "/w/a") is False  # held: no load, and now the newest
        loader.release(ep, "a")
        clock.now = 3
        assert await loader.ensure(s, ep, "c", "/w/c") is True  # full: b, least recently used, goes
        assert await loaded(s, sim.url) == {"a", "c"} and loader.holders("b") == []
        # `c` is in use (not released): a load that needs room takes `a`, never `c`.
        assert await loader.ensure(s, ep, "d", "/w/d") is True
        assert await loaded(s, sim.url) == {"c", "d"}
        # Both in use: the next load waits until one is released.
        waiting = asyncio.create_task(loader.ensure(s, ep, "e", "/w/e"))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        loader.release(ep, "c")
        assert await asyncio.wait_for(waiting, 5) is True
        assert await loaded(s, sim.url) == {"d", "e"}
        loader.release(ep, "d")
        loader.release(ep, "e")
        assert (loader.stats.loads, loader.stats.unloads) == (5, 3)
        # Idle long enough: AdapterSlots names them, oldest first, and an unload takes them off.
        clock.now = 1000
        assert loader.slots(ep).idle(clock.now, 600) == ["d", "e"]
        for name in ("d", "e"):
            await loader.unload(s, ep, name)
        assert await loaded(s, sim.url) == set() and loader.holders("d") == []


async def test_a_refused_load_is_an_error_with_the_engines_reason(sim_factory: SimFactory) -> None:
    sim = sim_factory("--served-model-name", "base")  # no --enable-lora: no adapter API
    loader = AdapterLoader(cap=2)
    async with aiohttp.ClientSession() as s:
        with pytest.raises(AdapterError, match="HTTP 404"):
            await loader.ensure(s, f"127.0.0.1:{sim.port}", "a", "/w/a")
    assert loader.stats.failures == 1 and "a on 127.0.0.1" in loader.stats.last_failure
    assert loader.holders("a") == []


def test_slots_refuse_a_cap_below_one() -> None:
    with pytest.raises(ValueError, match="at least one"):
        AdapterSlots(0)


async def test_affinity_keeps_loads_well_below_random_placement() -> None:
    """3 replicas, 20 adapters, 4 per replica: the gateway's adapter filters against random."""
    args = argparse.Namespace(replicas=3, adapters=20, max_adapters=4, clients=4, load_ms=0.0)
    names = workload(400, 20, 1.0)
    affinity = await run_policy("affinity", args, names)
    placed_at_random = await run_policy("random", args, names)
    assert affinity["loads"] < 0.7 * placed_at_random["loads"], (affinity, placed_at_random)
    assert affinity["answered_without_load"] > placed_at_random["answered_without_load"]


def slots_with(cap: int, used: dict[str, float], pins: dict[str, int] | None = None) -> AdapterSlots:
    slots = AdapterSlots(cap)
    for name, at in sorted(used.items(), key=lambda kv: kv[1]):
        slots.touch(name, at)
    slots.pins.update(pins or {})
    return slots


def test_a_load_goes_to_a_free_slot_on_the_least_loaded_replica_first() -> None:
    slots = {"a": slots_with(2, {"x": 1}), "b": slots_with(2, {"y": 2, "z": 3})}
    ready = {"a": (5, 0), "b": (0, 0), "c": (3, 0)}  # c holds nothing yet
    assert choose(ready, slots, {}, set(), cap=2) == ("c", None)
    assert choose(ready, slots, {"c": 2}, set(), cap=2) == ("a", None)  # c's slots are being filled


def test_else_the_least_recently_used_adapter_no_request_uses_is_evicted() -> None:
    slots = {"a": slots_with(2, {"x": 1, "w": 4}, pins={"x": 1}), "b": slots_with(2, {"y": 2, "z": 3})}
    ready = {"a": (0, 0), "b": (9, 0)}
    # x is the oldest but in use; y (on the busier replica) is the oldest one free to go.
    assert choose(ready, slots, {}, set(), cap=2) == ("b", "y")
    assert choose(ready, slots, {}, {("b", "y")}, cap=2) == ("b", "z")  # y is already on its way out
    every = {"a": slots_with(1, {"x": 1}, pins={"x": 1}), "b": slots_with(1, {"y": 2}, pins={"y": 3})}
    assert choose(ready, every, {}, set(), cap=1) is None  # all in use: the request waits


def test_the_demand_book_sums_adapter_use_over_gateways() -> None:
    book = DemandBook()
    for gateway, (queued, in_flight, routed) in {"g1": (1, 2, 5), "g2": (2, 0, 3)}.items():
        report = demand_pb2.DemandReport(
            gateway_id=gateway,
            instance=gateway,
            sequence=1,
            models=[
                demand_pb2.ModelDemand(
                    model="chat",
                    adapters=[
                        demand_pb2.AdapterDemand(
                            adapter="sql",
                            queued=queued,
                            uses=[
                                demand_pb2.AdapterUse(endpoint="e1", in_flight=in_flight, routed=routed),
                                demand_pb2.AdapterUse(endpoint="e2", queued=1),
                            ],
                        )
                    ],
                ),
            ],
        )
        assert book.apply(report, now=0.0) == (True, "")
    (total,) = book.adapter_totals("chat").values()
    assert (total.queued, total.wanted, total.in_flight, total.held) == (3, {"e2": 2}, {"e1": 2}, 5)
    assert total.routed == {"e1": 8, "e2": 0}
    assert book.adapter_totals("other") == {}
    huge = demand_pb2.DemandReport(
        gateway_id="g3",
        instance="g3",
        sequence=1,
        models=[
            demand_pb2.ModelDemand(model="chat", adapters=[demand_pb2.AdapterDemand(adapter="sql", queued=10**7)]),
        ],
    )
    assert book.apply(huge, now=0.0)[0] is False


def hotswap_of(ready: dict[str, tuple[int, int]], totals: dict[str, AdapterLoad], tmp_path: Path) -> HotSwap:
    manifest = model_doc("chat", extra="  adapters: {maxAdapters: 2}\n") + adapter_doc("sql", "chat", "file://sql")
    (model,) = parse_models(manifest)
    return HotSwap(
        model,
        Delivery(DeliveryConfig(tmp_path), Access()),
        base_dir=tmp_path,
        demand=lambda: totals,
        ready=lambda: ready,
        publish=lambda: None,
    )


async def test_a_copy_goes_elsewhere_only_when_every_holder_is_saturated(tmp_path: Path) -> None:
    busy = {"e1": (9, 6), "e2": (1, 0)}
    in_use = {"sql": AdapterLoad(in_flight={"e1": 3})}
    swap = hotswap_of(busy, in_use, tmp_path)
    swap.loader.slots("e1").touch("sql", 0.0)
    swap.reconcile()
    assert swap.records["sql"].loading == {"e2"}  # a copy into e2's free slot
    calm = hotswap_of({"e1": (5, 4), "e2": (1, 0)}, in_use, tmp_path)
    calm.loader.slots("e1").touch("sql", 0.0)
    calm.reconcile()
    assert calm.records["sql"].loading == set()  # 4 waiting is not saturated: requests stay on e1
    held = hotswap_of({"e1": (0, 0), "e2": (3, 0)}, {"sql": AdapterLoad(queued=2)}, tmp_path)
    held.reconcile()
    assert held.records["sql"].loading == {"e1"}  # held, on no replica: the least loaded loads it
    assert held.routed(routed_adapters(held.model))[0].endpoints == ()  # not until it is loaded


async def test_a_load_asked_for_one_replica_waits_while_every_adapter_there_is_in_use(tmp_path: Path) -> None:
    totals = {
        "sql": AdapterLoad(wanted={"e1": 1}),
        "x": AdapterLoad(in_flight={"e1": 1}),
        "y": AdapterLoad(in_flight={"e1": 2}),
    }
    swap = hotswap_of({"e1": (3, 0)}, totals, tmp_path)
    swap.loader.slots("e1").touch("x", 0.0)
    swap.loader.slots("e1").touch("y", 1.0)
    swap.reconcile()
    assert swap.records["sql"].loading == set()  # nothing to evict: no load started (nor retried)
    del totals["x"]  # x's request ended: now it can make room
    swap.reconcile()
    assert swap.records["sql"].loading == {"e1"}


async def test_an_adapter_one_request_uses_is_kept_though_the_engine_reports_nothing_running(
    sim_factory: SimFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gateway reports the request in flight before the engine shows it (or after the engine's
    own count went stale): that report alone keeps the adapter."""
    monkeypatch.setattr(hotswap, "UNROUTE_SECONDS", 0.0)
    sim = sim_factory("--served-model-name", "base", "--enable-lora", "--max-loras", "2")
    ep = f"127.0.0.1:{sim.port}"
    totals = {"sql": AdapterLoad(in_flight={ep: 1})}
    swap = hotswap_of({ep: (0, 0)}, totals, tmp_path)
    async with aiohttp.ClientSession() as s:
        assert await swap.loader.ensure(s, ep, "sql", "/w/sql") is True
        swap.loader.release(ep, "sql")
        assert await swap._evict(s, ep, "sql", "idle") is False
        assert await loaded(s, sim.url) == {"sql"}
        totals["sql"] = AdapterLoad(routed={ep: 1})  # the request ended: now it may go
        assert await swap._evict(s, ep, "sql", "idle") is True
        assert await loaded(s, sim.url) == set()
