"""LoRA hot swap through `wakegate up` (real Envoy, both extprocs, sim replicas with vLLM's run-time
adapter API): a base with more adapters than `maxAdapters` loads each on demand into a running
replica, evicts the least recently used one no request uses, unloads idle ones, keeps one a stream
uses, fails requests for an adapter whose weights are missing with the reason, and wakes a base at
zero once for adapter requests. The sim answers with the adapter's name as `model`, and only for an
adapter it holds, so every answer proves which adapter served it."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.http import get_json
from tests.support.up import UpProcess, adapter_doc, model_doc

ADAPTERS = ("a0", "a1", "a2", "a3", "a4")


def fleet(scaling: str, adapters: str, sources: dict[str, str] | None = None) -> str:
    extra = f"""  servedName: org/chat
  args: [--tokens-per-second, "50"]
  adapters: {adapters}
  scaling: {scaling}
"""
    docs = [model_doc("chat", extra=extra)]
    for name in ADAPTERS:
        docs.append(adapter_doc(name, "chat", (sources or {}).get(name, f"file://adapters/{name}"), f"chat-{name}"))
    return "".join(docs)


def make_adapters(tmp: Path) -> None:
    for name in ADAPTERS:
        (tmp / "adapters" / name).mkdir(parents=True)
        (tmp / "adapters" / name / "adapter_config.json").write_text("{}")


def chat(up: UpProcess) -> dict[str, Any]:
    return next(m for m in up.status()["models"] if m["key"] == "chat")


def engine_adapters(up: UpProcess) -> dict[str, set[str]]:
    """Replica name -> the adapters its engine itself lists."""
    out = {}
    for replica in chat(up)["replicas"]:
        listed = get_json(f"http://127.0.0.1:{replica['port']}/v1/models")["data"]
        out[f"chat-{replica['index']}"] = {m["id"].removeprefix("chat-") for m in listed if m.get("parent")}
    return out


def ask(up: UpProcess, adapter: str, max_tokens: int = 2) -> str:
    client = openai.OpenAI(base_url=up.base_url, api_key="unused", max_retries=0, timeout=60)
    return client.completions.create(model=adapter, prompt="hello", max_tokens=max_tokens).model


def unloads(up: UpProcess, reason: str) -> dict[str, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{up.admin_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("wakegate_adapter_unloads_total{") and f'reason="{reason}"' in line:
            adapter = line.split('adapter="', 1)[1].split('"', 1)[0]
            out[adapter.removeprefix("chat-")] = int(float(line.rsplit(" ", 1)[1]))
    return out


def poll(check: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


@pytest.fixture
def warm(tmp_path: Path) -> Iterator[UpProcess]:
    """Two replicas always up, two adapters each at most, five adapters."""
    make_adapters(tmp_path)
    up = UpProcess(tmp_path, fleet("{min: 2, max: 2, activationTimeout: 30}", "{maxAdapters: 2}"))
    try:
        up.wait_ready({"chat": 2}, timeout=60)
        yield up
    finally:
        assert up.stop() == 0, up.log()


def test_more_adapters_than_slots_are_swapped_in_by_lru_and_an_adapter_in_use_stays(warm: UpProcess) -> None:
    up = warm
    assert engine_adapters(up) == {"chat-0": set(), "chat-1": set()}  # 5 > 2: nothing preloaded
    # Each adapter is answered by itself; four fill both replicas' slots, the fifth evicts the
    # least recently used (a0). Pauses let each use reach `up` before the next.
    for name in ADAPTERS:
        assert ask(up, f"chat-{name}") == f"chat-{name}"
        time.sleep(0.6)
    held = engine_adapters(up)
    assert sorted(n for names in held.values() for n in names) == ["a1", "a2", "a3", "a4"], held
    assert unloads(up, "evicted") == {"a0": 1}
    status = chat(up)
    assert status["adapter_loads"]["loads"] == 5
    assert [status["adapters"][n]["loads"] for n in ADAPTERS] == [1, 1, 1, 1, 1]
    # a1 is used again; a0 comes back and takes the slot of the least recently used now: a2.
    assert ask(up, "chat-a1") == "chat-a1"
    time.sleep(0.6)
    assert ask(up, "chat-a0") == "chat-a0"
    assert unloads(up, "evicted") == {"a0": 1, "a2": 1}
    held = engine_adapters(up)
    assert sorted(n for names in held.values() for n in names) == ["a0", "a1", "a3", "a4"], held
    # Using an adapter that is held costs no load.
    before = chat(up)["adapter_loads"]["loads"]
    for name in ("a0", "a1", "a3", "a4", "a1"):
        assert ask(up, f"chat-{name}") == f"chat-{name}"
    assert chat(up)["adapter_loads"]["loads"] == before
    status = chat(up)["adapters"]
    assert all(status[n]["failure"] is None for n in ADAPTERS)
    assert {r for n in ("a0", "a1", "a3", "a4") for r in status[n]["replicas"]} == {"chat-0", "chat-1"}
    assert status["a2"]["replicas"] == [] and status["a2"]["unloads"] == 1

    # A slow stream keeps its adapter: the other adapters cycle through every slot meanwhile,
    # and the streamed one is neither unloaded nor cut.
    streamed: dict[str, Any] = {}

    def stream() -> None:
        client = openai.OpenAI(base_url=up.base_url, api_key="unused", max_retries=0, timeout=60)
        parts = client.completions.create(model="chat-a3", prompt="hi", max_tokens=600, stream=True)
        chunks = list(parts)
        streamed.update(model={c.model for c in chunks}, text="".join(c.choices[0].text for c in chunks if c.choices))

    reader = threading.Thread(target=stream)
    reader.start()
    time.sleep(0.6)
    for name in ("a2", "a0", "a1", "a4", "a2", "a0"):
        assert ask(up, f"chat-{name}") == f"chat-{name}"
        time.sleep(0.4)
    assert reader.is_alive(), "the stream ended before the swaps: make it longer"
    reader.join(60)
    assert streamed["model"] == {"chat-a3"} and streamed["text"]
    assert "a3" not in unloads(up, "evicted")
    assert any("a3" in names for names in engine_adapters(up).values())


@pytest.fixture
def asleep(tmp_path: Path) -> Iterator[UpProcess]:
    """One replica from zero, adapters unloaded after 2 s unused, a4's weights missing."""
    make_adapters(tmp_path)
    manifest = fleet(
        "{min: 0, max: 1, idleTimeout: 300, activationTimeout: 30}",
        "{maxAdapters: 2, idleTimeout: 2}",
        {"a4": "file://adapters/missing"},
    )
    up = UpProcess(tmp_path, manifest)
    try:
        up.wait_ready({"chat": 0}, timeout=60)
        yield up
    finally:
        assert up.stop() == 0, up.log()


def test_a_base_at_zero_wakes_once_for_adapters_and_idle_or_broken_adapters_say_so(asleep: UpProcess) -> None:
    up = asleep
    # Three requests for two adapters of the sleeping base: one activation, each its own adapter.
    answers: dict[int, str] = {}
    names = ("a0", "a1", "a0")
    threads = [
        threading.Thread(target=lambda i=i, n=n: answers.__setitem__(i, ask(up, f"chat-{n}")))
        for i, n in enumerate(names)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert answers == {0: "chat-a0", 1: "chat-a1", 2: "chat-a0"}
    assert up.log().count("scale model=chat from=0 to=1") == 1
    (replica,) = chat(up)["replicas"]
    # Loaded before the replica was routed: no request waited on a running replica for them.
    assert chat(up)["adapters"]["a0"]["replicas"] == ["chat-0"]

    # Missing weights: a 503 with the reason, counted in /status; the other adapters serve on.
    client = openai.OpenAI(base_url=up.base_url, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="chat-a4", prompt="hello", max_tokens=2)
    assert refused.value.status_code == 503
    error = refused.value.body
    assert isinstance(error, dict), error
    assert error["code"] == "adapter_unavailable" and "adapters/missing" in error["message"], error
    failure = chat(up)["adapters"]["a4"]["failure"]
    assert failure is not None and "adapters/missing" in failure["message"]
    assert chat(up)["adapters"]["a4"]["failures"] >= 1
    assert ask(up, "chat-a2") == "chat-a2"
    assert chat(up)["replicas"][0]["pid"] == replica["pid"]

    # Unused for the adapters' idleTimeout: unloaded, the base itself stays.
    assert poll(lambda: engine_adapters(up) == {"chat-0": set()}), engine_adapters(up)
    # a2 took the slot of one of the two loaded at the wake (both used at once); idle took the rest.
    (evicted,) = unloads(up, "evicted")
    assert evicted in ("a0", "a1")
    assert unloads(up, "idle") == {({"a0", "a1"} - {evicted}).pop(): 1, "a2": 1}
    assert chat(up)["replicas"][0]["pid"] == replica["pid"]
    assert ask(up, "chat-a1") == "chat-a1"  # and comes back on demand
    assert up.log().count("scale model=chat from=0 to=1") == 1


def test_random_placement_loads_the_adapter_where_the_request_was_drawn(tmp_path: Path) -> None:
    make_adapters(tmp_path)
    up = UpProcess(tmp_path, fleet("{min: 2, max: 2, activationTimeout: 30}", "{maxAdapters: 2, placement: random}"))
    try:
        up.wait_ready({"chat": 2}, timeout=60)
        for name in ("a0", "a1", "a0", "a2", "a1", "a0", "a3", "a0"):
            assert ask(up, f"chat-{name}") == f"chat-{name}"
        status = chat(up)
        # Each request went wherever it was drawn, holder or not; a0, asked four times, was loaded
        # wherever it was missing. The engines hold what /status says, within the cap.
        held = engine_adapters(up)
        assert all(len(names) <= 2 for names in held.values()), held
        for name in ADAPTERS:
            assert sorted(status["adapters"][name]["replicas"]) == sorted(r for r, n in held.items() if name in n)
        assert status["adapter_loads"]["loads"] >= 4  # a0..a3 each at least once
    finally:
        assert up.stop() == 0, up.log()
