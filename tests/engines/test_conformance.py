"""One contract, two engines: the sim (`wakegate sim`) and real vLLM (the CPU build `e2e.engines`
installs, on a generated model) started with the same flags and held to the same answers in
everything wakegate reads or passes on: OpenAI shapes (chat and completions, streamed and not),
errors (status, envelope, type, param), `/health`, the `/metrics` families and labels that
picking, scaling and the dashboards use, the run-time LoRA API's status codes, and the KV-event
wire format. Where the sim cannot do what vLLM does, the test says so in one place.

Each engine is started once for the module (vLLM's cold start is about a minute here).
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import zmq
from openai import OpenAI

from tests.engines.conftest import VLLM_ARGS, EngineProcess, HFTiny, start_engine
from tests.support import REPO_ROOT
from wakegate.control.admin import free_port

SERVED = "tiny"
MAX_MODEL_LEN = 512


@dataclass(frozen=True)
class Engine:
    kind: str
    process: EngineProcess
    events_port: int
    adapters: HFTiny

    @property
    def url(self) -> str:
        return self.process.url


def common_flags(port: int, events_port: int) -> list[str]:
    """What both engines are started with (the sim takes vLLM's flags, ignoring those about compute)."""
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events_port}",
        "topic": "kv-events",
    }
    return [
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED, *VLLM_ARGS,
        "--enable-lora", "--max-loras", "2", "--enable-prefix-caching", "--kv-events-config", json.dumps(events),
    ]  # fmt: skip


@pytest.fixture(scope="module", params=["sim", "vllm"])
def engine(request: pytest.FixtureRequest, hf_tiny: HFTiny) -> Iterator[Engine]:
    port, events_port = free_port(), free_port()
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "PYTHONUNBUFFERED": "1"}
    env.pop("VLLM_API_KEY", None)
    if request.param == "sim":
        program = [sys.executable, "-m", "wakegate", "sim"]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT / "proto"), env.get("PYTHONPATH")]))
    else:
        program = [str(request.getfixturevalue("vllm_bin"))]
    argv = [*program, "--model", str(hf_tiny.model), *common_flags(port, events_port)]
    process = start_engine(argv, port, "/health", env=env, timeout=400)
    yield Engine(request.param, process, events_port, hf_tiny)
    assert process.stop(timeout=60) == 0, process.log()


def call(engine: Engine, method: str, path: str, body: object = None, raw: bytes | None = None) -> tuple[int, str]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(f"{engine.url}{path}", data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def error_of(status: int, text: str) -> dict[str, Any]:
    """The OpenAI error envelope, checked: {"error": {message, type, param, code = the status}}."""
    body = json.loads(text)
    assert set(body) == {"error"}, body
    error = body["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    assert isinstance(error["message"], str) and error["message"] and error["code"] == status, error
    return dict(error)


def chat_body(**extra: object) -> dict[str, object]:
    return {"model": SERVED, "messages": [{"role": "user", "content": "tell me about the weather"}],
            "max_tokens": 5, "temperature": 0, **extra}  # fmt: skip


def test_health_is_an_empty_200(engine: Engine) -> None:
    assert call(engine, "GET", "/health") == (200, "")


def test_models_lists_the_served_name(engine: Engine) -> None:
    status, text = call(engine, "GET", "/v1/models")
    body = json.loads(text)
    assert status == 200 and body["object"] == "list"
    (model,) = body["data"]
    assert (model["id"], model["object"], model["owned_by"], model["parent"]) == (SERVED, "model", "vllm", None)
    assert model["max_model_len"] == MAX_MODEL_LEN and isinstance(model["root"], str)
    assert isinstance(model["created"], int)


def test_chat_and_completions_have_openais_shapes(engine: Engine) -> None:
    client = OpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(**chat_body())  # type: ignore[call-overload]
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion" and reply.model == SERVED
    (choice,) = reply.choices
    assert (choice.index, choice.message.role, choice.finish_reason) == (0, "assistant", "length")
    assert choice.message.content
    usage = reply.usage
    assert usage is not None and usage.completion_tokens == 5 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    text = client.completions.create(model=SERVED, prompt="the weather", max_tokens=4, temperature=0)
    assert text.id.startswith("cmpl-") and text.object == "text_completion" and text.model == SERVED
    assert text.choices[0].finish_reason == "length" and text.usage is not None and text.usage.completion_tokens == 4

    # Streamed, on the wire: `data:` events, a first chunk with the role, the finish reason on the
    # last choice, a usage chunk with no choices, then [DONE].
    request = urllib.request.Request(
        f"{engine.url}/v1/chat/completions",
        data=json.dumps(chat_body(stream=True, stream_options={"include_usage": True})).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = [line[len("data: ") :] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == SERVED for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    *with_choices, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    assert with_choices[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in with_choices)


@pytest.mark.parametrize(
    ("case", "path", "body", "status", "kind", "param"),
    [
        ("unknown model", "/v1/chat/completions", {**chat_body(), "model": "nope"}, 404, "NotFoundError", "model"),
        ("too many tokens", "/v1/chat/completions", chat_body(max_tokens=100_000), 400, "BadRequestError",
         "max_tokens"),
        ("not JSON", "/v1/chat/completions", b"not json", 400, None, None),
        ("messages not a list", "/v1/chat/completions", {"model": SERVED, "messages": "x"}, 400, None, None),
        ("unload of an adapter never loaded", "/v1/unload_lora_adapter", {"lora_name": "never"}, 404,
         "NotFoundError", None),
        ("load without a path", "/v1/load_lora_adapter", {"lora_name": "x"}, 400, None, None),
    ],
)  # fmt: skip
def test_errors_have_the_status_and_envelope(
    engine: Engine, case: str, path: str, body: object, status: int, kind: str | None, param: str | None
) -> None:
    got, text = call(engine, "POST", path, raw=body) if isinstance(body, bytes) else call(engine, "POST", path, body)
    assert got == status, (case, text)
    error = error_of(got, text)
    if kind is not None:
        assert error["type"] == kind, (case, error)
    if param is not None:
        assert error["param"] == param, (case, error)


#: what wakegate reads (picking, scaling, the KV agent, dashboards): family -> its type
FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:lora_requests_info": "gauge",
}


def samples(text: str) -> dict[str, list[dict[str, str]]]:
    """Sample name -> the label sets it has."""
    out: dict[str, list[dict[str, str]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition("{")
        labels: dict[str, str] = {}
        if rest:
            inside = rest[: rest.rindex("}")]
            for part in filter(None, inside.split('",')):
                key, _, value = part.partition('="')
                labels[key.strip(",")] = value.rstrip('"')
        else:
            name = name.split()[0]
        out.setdefault(name, []).append(labels)
    return out


def test_metrics_have_the_families_and_labels_wakegate_reads(engine: Engine) -> None:
    call(engine, "POST", "/v1/chat/completions", chat_body())  # every family has had a request
    status, text = call(engine, "GET", "/metrics")
    assert status == 200
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE "))
    for family, kind in FAMILIES.items():
        assert types.get(family, types.get(f"{family}_total")) == kind, family
    found = samples(text)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_hits_total", "vllm:generation_tokens_total"):  # fmt: skip
        assert found[name] == [{"engine": "0", "model_name": SERVED}], (name, found.get(name))
    assert {ls["finished_reason"] for ls in found["vllm:request_success_total"]} >= {"length", "stop"}
    assert {"le", "engine", "model_name"} <= set(found["vllm:time_to_first_token_seconds_bucket"][0])
    (info, *_) = found["vllm:lora_requests_info"]
    assert set(info) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"} and info["max_lora"] == "2"


def test_the_lora_api_loads_serves_refuses_and_unloads(engine: Engine) -> None:
    sql, poet = str(engine.adapters.sql), str(engine.adapters.poet)
    load = "/v1/load_lora_adapter"
    status, text = call(engine, "POST", load, {"lora_name": "sql", "lora_path": sql})
    assert (status, text) == (200, "Success: LoRA adapter 'sql' added successfully.")
    status, text = call(engine, "POST", load, {"lora_name": "sql", "lora_path": sql})
    assert status == 400 and "already been loaded" in error_of(status, text)["message"]
    assert call(engine, "POST", load, {"lora_name": "poet", "lora_path": poet})[0] == 200
    status, text = call(engine, "GET", "/v1/models")
    parents = {m["id"]: m["parent"] for m in json.loads(text)["data"]}
    assert parents == {SERVED: None, "sql": SERVED, "poet": SERVED}
    status, text = call(engine, "POST", "/v1/chat/completions", {**chat_body(), "model": "sql"})
    assert status == 200 and json.loads(text)["model"] == "sql"

    status, text = call(engine, "POST", "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert (status, text) == (200, "Success: LoRA adapter 'sql' removed successfully.")
    status, text = call(engine, "POST", "/v1/chat/completions", {**chat_body(), "model": "sql"})
    assert status == 404 and error_of(status, text)["type"] == "NotFoundError"
    assert call(engine, "POST", "/v1/unload_lora_adapter", {"lora_name": "poet"})[0] == 200

    # A path with no adapter: vLLM looks and answers 404. The sim holds no weights and takes any
    # path (on a cluster it is given paths inside a pod that do not exist where it runs).
    status, text = call(engine, "POST", load, {"lora_name": "gone", "lora_path": "/nonexistent/adapter"})
    if engine.kind == "vllm":
        assert status == 404 and error_of(status, text)["type"] == "NotFoundError"
    else:
        assert status == 200
        call(engine, "POST", "/v1/unload_lora_adapter", {"lora_name": "gone"})


def test_kv_events_have_the_wire_format(engine: Engine) -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.setsockopt(zmq.RCVTIMEO, 10_000)
    sub.connect(f"tcp://127.0.0.1:{engine.events_port}")  # the engine binds (`tcp://*:PORT`)
    try:
        deadline = time.monotonic() + 60
        stored: list[dict[str, Any]] = []
        while not stored and time.monotonic() < deadline:
            # A prompt of a few hundred tokens fills whole blocks of either engine (vLLM's CPU
            # blocks hold 128 tokens; the sim's 16 words). A fresh one each time, so its blocks are
            # new: a subscription still joining misses the first batches.
            prompt = f"{time.time_ns()} " + "the weather is sunny " * 60
            body = {"model": SERVED, "prompt": prompt, "max_tokens": 2}
            assert call(engine, "POST", "/v1/completions", body)[0] == 200
            try:
                while True:
                    topic, seq, payload = sub.recv_multipart()
                    assert topic == b"kv-events" and len(seq) == 8
                    batch = msgpack.unpackb(payload, raw=False)
                    ts, events, rank = batch
                    assert isinstance(ts, float) and rank == 0
                    for event in events:
                        assert isinstance(event, dict) and event["type"] in (
                            "BlockStored", "BlockRemoved", "AllBlocksCleared")  # fmt: skip
                        stored += [event] if event["type"] == "BlockStored" else []
                    if stored:
                        break
            except zmq.Again:
                continue
    finally:
        sub.close(linger=0)
        ctx.term()
    assert stored, "no BlockStored event"
    event = stored[0]
    assert {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"} <= set(event)
    assert event["block_hashes"] and isinstance(event["block_size"], int) and event["lora_id"] is None
    assert all(isinstance(h, int | bytes) for h in event["block_hashes"])
