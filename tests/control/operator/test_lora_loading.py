"""The operator loading vLLM-style adapters into ready pods, against real simulators on loopback
(`wakegate sim --enable-lora --max-loras N` answers `/v1/load_lora_adapter` as vLLM does)."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request
from collections.abc import Iterator

import pytest

from tests.support.sim import SimProcess, start_sim
from wakegate.control.operator.lora_loading import RuntimeLoader, Wanted
from wakegate.control.operator.lora_status import ready_pods


@pytest.fixture
def sims() -> Iterator[list[SimProcess]]:
    started = [start_sim(0, "--enable-lora", "--max-loras", "2") for _ in range(2)]
    try:
        yield started
    finally:
        for sim in started:
            sim.stop()


def pod(name: str, sim: SimProcess, ready: bool = True) -> dict[str, object]:
    return {
        "metadata": {"name": name, "uid": f"uid-{name}"},
        "spec": {"containers": [{"name": "backend", "ports": [{"name": "http", "containerPort": sim.port}]}]},
        "status": {
            "podIP": "127.0.0.1",
            "conditions": [
                {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": "2026-12-01T10:00:00Z"}
            ],
        },
    }


def engine_adapters(sim: SimProcess) -> set[str]:
    with urllib.request.urlopen(f"{sim.url}/v1/models", timeout=5) as resp:
        listed = {m["id"] for m in json.loads(resp.read())["data"]}
    return listed - {"sim-model"} - {m for m in listed if not m.startswith("lora-")}


def sync(loader: RuntimeLoader, pods: list[dict[str, object]], *names: str) -> bool:
    wanted = [Wanted(n, f"lora-{n}", f"/models/lora/{n}") for n in names]
    return asyncio.run(loader.sync("ns/chat", pods, wanted, ready_pods(pods)))


def test_every_ready_pod_gets_each_adapter_once_and_loses_the_removed_ones(sims: list[SimProcess]) -> None:
    loader = RuntimeLoader()
    pods = [pod("p0", sims[0]), pod("p1", sims[1]), pod("starting", sims[1], ready=False)]
    assert sync(loader, pods, "a", "b")
    assert [engine_adapters(s) for s in sims] == [{"lora-a", "lora-b"}, {"lora-a", "lora-b"}]
    assert set(loader.holders("ns/a")) == {"p0", "p1"}
    assert not sync(loader, pods, "a", "b"), "nothing to do: no call, no change"
    assert sync(loader, pods, "b", "c")
    assert [engine_adapters(s) for s in sims] == [{"lora-b", "lora-c"}, {"lora-b", "lora-c"}]
    assert loader.holders("ns/a") == {} and set(loader.holders("ns/c")) == {"p0", "p1"}
    # A pod that went away takes its adapters with it.
    assert sync(loader, pods[:1], "b", "c")
    assert set(loader.holders("ns/b")) == {"p0"}


def test_a_refused_load_is_kept_with_the_engines_answer_and_an_operator_restart_loads_nothing_twice(
    sims: list[SimProcess],
) -> None:
    loader = RuntimeLoader()
    pods = [pod("p0", sims[0])]
    sync(loader, pods, "a", "b", "c")  # the engine holds two: --max-loras 2
    assert set(loader.holders("ns/a")) == {"p0"} and set(loader.holders("ns/b")) == {"p0"}
    assert loader.holders("ns/c") == {}
    assert "--max-loras" in loader.failures["ns/c"] and "pod p0: HTTP 400" in loader.failures["ns/c"]
    assert loader.take_failures("ns/c") == 1 and loader.take_failures("ns/c") == 0
    restarted = RuntimeLoader()
    sync(restarted, pods, "a", "b")
    assert set(restarted.holders("ns/a")) == {"p0"} and restarted.failures == {}, "already loaded counts as held"
    assert sims[0].status("/health") == 200


def test_an_engine_that_does_not_answer_is_a_failure_with_the_reason(sims: list[SimProcess]) -> None:
    gone = sims[1]
    gone.stop()
    loader = RuntimeLoader()
    sync(loader, [pod("p1", gone)], "a")
    assert loader.holders("ns/a") == {}
    assert "cannot reach the engine" in loader.failures["ns/a"]


def test_two_reconciles_of_one_base_at_once_load_each_adapter_once(
    sims: list[SimProcess], caplog: pytest.LogCaptureFixture
) -> None:
    loader = RuntimeLoader()
    pods = [pod("p0", sims[0])]
    wanted = [Wanted(n, f"lora-{n}", f"/models/lora/{n}") for n in ("a", "b")]

    async def twice() -> None:
        await asyncio.gather(*(loader.sync("ns/chat", pods, wanted, ready_pods(pods)) for _ in range(2)))

    with caplog.at_level(logging.INFO, logger="wakegate.operator.lora"):
        asyncio.run(twice())
    loads = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded LoRAAdapter")]
    assert sorted(m.split()[2] for m in loads) == ["ns/a", "ns/b"]
    assert engine_adapters(sims[0]) == {"lora-a", "lora-b"}
