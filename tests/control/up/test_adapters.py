"""Hot swap of LoRA adapters on engines that load them at run time, against real sim processes
with vLLM's adapter API: the per-replica cap with LRU, adapters in use never unloaded, idle ones
unloaded, failures kept with the engine's reason; and on a fleet, affinity picking keeps the
loads well below random placement."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Iterator

import aiohttp
import pytest

from tests.bench.bench_lora import run_policy, workload
from tests.support.sim import SimFactory, SimProcess, start_sim
from wakegate.control.up.adapters import AdapterError, AdapterLoader, AdapterSlots


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
        # Idle for the timeout: unloaded.
        clock.now = 1000
        assert sorted(await loader.sweep(s, idle_seconds=600)) == [(ep, "d"), (ep, "e")]
        assert await loaded(s, sim.url) == set()


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
