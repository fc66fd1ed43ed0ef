"""`wakegate up` running real vLLM (the CPU build `e2e.engines` installs) on a generated Hugging
Face model folder: asleep until the first request, answered through the gateway by the official
openai client (streamed and not), two LoRAAdapters loaded into the running engine through vLLM's
own API and answering with their own outputs, /status showing the load vLLM's metrics report, and
the KV events `routing.kvEvents` asks for published by vLLM and taken by the gateway.

One engine start serves the whole module (a vLLM cold start is about a minute on two cores and the
engine holds ~4 GB): the tests run in order on the replica the first one woke.
"""

from __future__ import annotations

import json
import shutil
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgpack
import openai
import pytest
import zmq

from tests.engines.conftest import PROMPT, HFTiny, vllm_model
from tests.engines.test_up_engines import engines_path, model_status, wait_for
from tests.support.up import UpProcess, pids_alive
from wakegate.extproc.engineprompt import EnginePrompt
from wakegate.kvevents import vllm_block_hashes

FLEET = vllm_model(
    "{profile: precise, kvEvents: {portOffset: 1}}",
    "{min: 0, max: 1, idleTimeout: 900, activationTimeout: 300}",
    extra="  adapters: {maxAdapters: 2}\n",
) + """---
apiVersion: wakegate.io/v1alpha1
kind: LoRAAdapter
metadata: {name: sql}
spec: {baseModel: tiny, source: file://weights/sql, servedName: tiny-sql}
---
apiVersion: wakegate.io/v1alpha1
kind: LoRAAdapter
metadata: {name: poet}
spec: {baseModel: tiny, source: file://weights/poet}
"""

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, hf_tiny: HFTiny, vllm_bin: Path) -> Iterator[UpProcess]:
    tmp = tmp_path_factory.mktemp("up-vllm")
    (tmp / "weights").mkdir()
    for name, folder in (("tiny", hf_tiny.model), ("sql", hf_tiny.sql), ("poet", hf_tiny.poet)):
        shutil.copytree(folder, tmp / "weights" / name)
    up = UpProcess(tmp, FLEET, env=engines_path(vllm_bin))
    try:
        up.wait_ready({"tiny": 0}, timeout=90)
        yield up
    finally:
        assert up.stop() == 0, up.log()


def client(up: UpProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=up.base_url, api_key="unused", max_retries=0, timeout=300)


def ask(up: UpProcess, model: str) -> str:
    reply = client(up).chat.completions.create(
        model=model,
        messages=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,  # type: ignore[arg-type]
    )
    assert reply.usage is not None and reply.usage.completion_tokens == MAX_TOKENS
    return reply.choices[0].message.content or ""


def the_replica(up: UpProcess) -> dict[str, object]:
    (replica,) = model_status(up, "tiny")["replicas"]  # type: ignore[misc]
    assert isinstance(replica, dict)
    return replica


def test_wakes_from_zero_and_answers_the_openai_client(fleet: UpProcess) -> None:
    up = fleet
    status = model_status(up, "tiny")
    assert status["replicas"] == [] and status["backend"] == "vllm"

    reply = client(up).chat.completions.create(
        model="tiny",
        messages=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,  # type: ignore[arg-type]
    )
    text = reply.choices[0].message.content or ""
    assert text and reply.model == "org/tiny-hf"
    assert reply.usage is not None and reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens == MAX_TOKENS
    assert up.log().count("scale model=tiny from=0 to=1") == 1
    # vLLM was given the model's folder (config, tokenizer, safetensors), not its one weight file.
    weights = Path(str(model_status(up, "tiny")["weights"]))
    assert weights.is_absolute() and weights.name == "tiny" and (weights / "config.json").is_file()
    replica = the_replica(up)
    assert pids_alive([int(replica["pid"])])  # type: ignore[call-overload]

    # Streamed: the same greedy text in pieces, the usage in the last chunk.
    pieces: list[str] = []
    usage = None
    for chunk in client(up).chat.completions.create(
        model="tiny",
        messages=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert "".join(pieces) == text and len(pieces) > 1
    assert usage is not None and usage.completion_tokens == MAX_TOKENS

    # The wake's timeline: the process started, vLLM's /health passed (the model is loaded by
    # then), the replica was routed.
    timeline = model_status(up, "tiny")["last_cold_start"]
    assert isinstance(timeline, dict)
    assert 0 <= timeline["process_start"] <= timeline["health_pass"] <= timeline["ready"]


def test_two_adapters_load_at_run_time_and_answer_as_themselves(fleet: UpProcess) -> None:
    up = fleet
    ask(up, "tiny")  # awake (a no-op when the first test ran)
    replica = the_replica(up)
    pid = int(replica["pid"])  # type: ignore[call-overload]

    # Interleaved: every answer is its adapter's (the same each time), and the three differ.
    answers: dict[str, set[str]] = {"tiny": set(), "sql": set(), "poet": set()}
    for name, key in [
        ("sql", "sql"),
        ("tiny", "tiny"),
        ("poet", "poet"),
        ("tiny-sql", "sql"),
        ("poet", "poet"),
        ("tiny", "tiny"),
        ("sql", "sql"),
        ("poet", "poet"),
    ]:
        answers[key].add(ask(up, name))
    assert all(len(texts) == 1 for texts in answers.values()), answers
    assert len({next(iter(texts)) for texts in answers.values()}) == 3, answers

    # Loaded into the running engine: the same process, never restarted, and vLLM itself lists
    # both adapters with the base as their parent.
    replica = the_replica(up)
    assert (int(replica["pid"]), replica["restarts"]) == (pid, 0)  # type: ignore[call-overload]
    assert up.log().count("scale model=tiny from=0 to=1") == 1
    with urllib.request.urlopen(f"http://127.0.0.1:{replica['port']}/v1/models", timeout=10) as resp:
        listed = {m["id"]: m.get("parent") for m in json.load(resp)["data"]}
    assert listed == {"org/tiny-hf": None, "tiny-sql": "org/tiny-hf", "poet": "org/tiny-hf"}
    status = model_status(up, "tiny")
    adapters = status["adapters"]
    assert isinstance(adapters, dict) and set(adapters) == {"sql", "poet"}
    for name in ("sql", "poet"):
        assert adapters[name]["replicas"] == [f"tiny-{replica['index']}"]
        assert adapters[name]["failure"] is None
    loads = status["adapter_loads"]
    assert isinstance(loads, dict) and loads["loads"] >= 2, loads


def test_status_shows_the_load_vllm_reports(fleet: UpProcess) -> None:
    up = fleet
    ask(up, "tiny")
    replica = the_replica(up)
    engine = f"http://127.0.0.1:{replica['port']}"
    # Requests sent straight to the engine: the gateway never sees them, only vLLM's metrics do.
    stop = threading.Event()

    def keep_busy() -> None:
        body = json.dumps({"model": "org/tiny-hf", "prompt": "tell me a story", "max_tokens": 400}).encode()
        while not stop.is_set():
            request = urllib.request.Request(
                f"{engine}/v1/completions", data=body, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=300) as resp:
                    resp.read()
            except OSError:
                return

    workers = [threading.Thread(target=keep_busy, daemon=True) for _ in range(3)]
    for worker in workers:
        worker.start()
    try:

        def busy() -> bool:
            load = the_replica(up)["engine_load"]
            return isinstance(load, dict) and load["running"] + load["waiting"] >= 2

        wait_for(busy, 120, "vLLM's metrics to show the requests it runs")
        load = the_replica(up)["engine_load"]
        assert isinstance(load, dict) and load["kv_usage"] is not None and 0 < load["kv_usage"] <= 1
    finally:
        stop.set()
        for worker in workers:
            worker.join(300)

    def idle() -> bool:
        load = the_replica(up)["engine_load"]
        return isinstance(load, dict) and load["running"] + load["waiting"] == 0

    wait_for(idle, 60, "vLLM's metrics to show it idle")


def test_vllm_publishes_the_kv_events_the_routing_asks_for(fleet: UpProcess) -> None:
    up = fleet
    ask(up, "tiny")
    replica = the_replica(up)
    port = int(replica["port"])  # type: ignore[call-overload]
    # up rendered the flags (the Model's args name none): vLLM binds port + portOffset.
    argv = Path(f"/proc/{replica['pid']}/cmdline").read_bytes().decode().split("\0")
    assert "--enable-prefix-caching" in argv
    config = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert config["endpoint"] == f"tcp://*:{port + 1}" and config["enable_kv_cache_events"] is True

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 10_000)
    sub.connect(f"tcp://127.0.0.1:{port + 1}")
    stored: list[dict[str, object]] = []
    sent: list[dict[str, object]] = []
    try:
        for attempt in range(5):
            # A prompt of whole 128-token blocks, through the gateway, new each time (a
            # subscription still joining misses the first batches).
            content = f"{attempt}" + " the weather" * 150
            sent.append({"messages": [{"role": "user", "content": content}]})
            client(up).chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": content}],
                max_tokens=2,  # type: ignore[arg-type]
            )
            try:
                _topic, _seq, payload = sub.recv_multipart()
            except zmq.Again:
                continue
            stored += [e for e in msgpack.unpackb(payload, raw=False)[1] if e["type"] == "BlockStored"]
            if stored:
                break
    finally:
        sub.close(0)
        ctx.term()
    assert stored and stored[0]["block_size"] == 128
    # The hashes are vLLM's SHA-256 chain over the block's token ids, which wakegate reproduces
    # from the ids alone (the half of precise scoring that needs no tokenizer).
    first = stored[0]
    assert first["parent_block_hash"] is None and first["lora_id"] is None
    assert vllm_block_hashes(first["token_ids"], 128) == first["block_hashes"]  # type: ignore[arg-type]
    # The other half: the gateway's token ids for the request (the model's chat template and
    # tokenizer) are the engine's, so the chain it computes names the blocks vLLM stored.
    prompt = EnginePrompt(up.tmp / "weights" / "tiny")
    ids = [prompt.token_ids(body) or [] for body in sent]  # the event is from one of those requests
    assert any(i[: len(first["token_ids"])] == first["token_ids"] for i in ids), (ids, first)  # type: ignore[arg-type]
    assert any(vllm_block_hashes(i, 128)[:1] == first["block_hashes"][:1] for i in ids)  # type: ignore[index]
    # The gateways subscribed to the same endpoint and decoded those batches (vLLM 0.32 sends
    # events as maps, which they once dropped as malformed).
    logs = sorted((up.state_dir / "logs").glob("extproc-*.log"))

    def subscribed() -> bool:
        return all(f"kv events subscribed endpoint=127.0.0.1:{port}" in log.read_text() for log in logs)

    wait_for(subscribed, 30, "the gateways to subscribe")
    assert logs and not any("kv events malformed" in log.read_text() for log in logs)
