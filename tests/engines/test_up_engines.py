"""`wakegate up` running the real engines: llama-server and Ollama on a generated GGUF, asleep
until a request comes, answered through the gateway by the official openai client, asleep again
when idle; least-loaded picking reads llama-server's own metrics."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.engines.conftest import PROMPT, TINY_LLAMA, TinyFiles
from tests.support.http import request
from tests.support.models import models
from tests.support.up import UpProcess, pids_alive
from tests.support.waiting import wait_for

#: The same file twice through relative paths: resolved against the manifest's folder.
FLEET = models(
    {
        "llama": {**TINY_LLAMA, "scaling": {"min": 0, "max": 1, "idleTimeout": 3, "activationTimeout": 120}},
        "olla": {
            "backend": "ollama",
            "servedName": "tiny-olla",
            "source": "file://weights/tiny.gguf",
            "env": {"OLLAMA_NUM_PARALLEL": "1", "OLLAMA_CONTEXT_LENGTH": "512"},
            "scaling": {"min": 0, "max": 1, "idleTimeout": 3, "activationTimeout": 120},
        },
    },
    namespace=None,
)


def engines_path(*binaries: Path) -> dict[str, str]:
    """The engines on PATH, as an installed engine would be."""
    dirs = dict.fromkeys(str(b.parent) for b in binaries)
    return {"PATH": os.pathsep.join([*dirs, os.environ.get("PATH", "")])}


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory, tiny: TinyFiles, llama_server_bin: Path, ollama_bin: Path
) -> Iterator[UpProcess]:
    tmp = tmp_path_factory.mktemp("up-engines")
    (tmp / "weights").mkdir()
    shutil.copy(tiny.model, tmp / "weights" / "tiny.gguf")
    up = UpProcess(tmp, FLEET, env=engines_path(llama_server_bin, ollama_bin))
    try:
        up.wait_ready({"llama": 0, "olla": 0}, timeout=90)
        yield up
    finally:
        assert up.stop() == 0, up.log()


def model_status(up: UpProcess, key: str) -> dict[str, object]:
    return next(m for m in up.status()["models"] if m["key"] == key)


@pytest.mark.parametrize(("key", "served"), [("llama", "org/tiny-llama"), ("olla", "tiny-olla")])
def test_engine_sleeps_wakes_answers_and_sleeps_again(fleet: UpProcess, key: str, served: str) -> None:
    up = fleet
    client = openai.OpenAI(base_url=up.base_url, api_key="unused", max_retries=0, timeout=120)
    wait_for(lambda: model_status(up, key)["replicas"] == [], 60, f"{key} to be asleep")
    # The model's own name is what clients send; the engine serves (and answers as) the served name.
    reply = client.chat.completions.create(model=key, messages=PROMPT, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    assert reply.choices[0].message.content
    assert reply.model.startswith(served)
    assert reply.usage is not None and reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens == 6
    status = model_status(up, key)
    (replica,) = status["replicas"]  # type: ignore[misc]
    pid = int(replica["pid"])
    assert pids_alive([pid]) == [pid]
    assert status["served_name"] == served
    assert str(status["weights"]).endswith("weights/tiny.gguf") and Path(str(status["weights"])).is_absolute()
    # The timeline of that wake, in seconds since the activation signal; the engine's first
    # answer (a one-token request sent once the replica is routed) completes it.
    wait_for(lambda: "first_byte" in model_status(up, key)["last_cold_start"], 30, "the first answer")  # type: ignore[operator]
    timeline = model_status(up, key)["last_cold_start"]
    assert isinstance(timeline, dict)
    assert 0 <= timeline["process_start"] <= timeline["health_pass"] <= timeline["model_loaded"] <= timeline["ready"]
    assert timeline["health_pass"] <= timeline["first_byte"]  # Ollama's answer loads it; llama's comes after

    # Streaming: the text arrives in pieces while the engine produces it, usage in the last chunk.
    started = time.monotonic()
    arrivals: list[float] = []
    usage = None
    stream = client.chat.completions.create(
        model=key,
        messages=PROMPT,
        max_tokens=200,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic() - started)
        usage = chunk.usage or usage
    assert len(arrivals) > 50
    assert usage is not None and usage.completion_tokens == 200 and usage.prompt_tokens > 0
    # Not buffered into one piece at the end: the first token came well before the last.
    assert arrivals[0] < arrivals[-1] * 0.8, (arrivals[0], arrivals[-1])

    # Idle for idleTimeout: the engine process goes away...
    wait_for(lambda: model_status(up, key)["replicas"] == [], 60, f"{key} to scale to zero")
    wait_for(lambda: pids_alive([pid]) == [], 20, "the engine process to exit")
    # ...and the next request wakes a new one.
    again = client.chat.completions.create(model=key, messages=PROMPT, max_tokens=3, temperature=0)  # type: ignore[arg-type]
    assert again.usage is not None and again.usage.completion_tokens == 3
    (replica,) = model_status(up, key)["replicas"]  # type: ignore[misc]
    assert int(replica["pid"]) != pid


def test_cold_start_stages_are_in_the_metrics(fleet: UpProcess) -> None:
    client = openai.OpenAI(base_url=fleet.base_url, api_key="unused", max_retries=0, timeout=120)
    client.chat.completions.create(model="llama", messages=PROMPT, max_tokens=2)  # type: ignore[arg-type]
    wait_for(lambda: "first_byte" in model_status(fleet, "llama")["last_cold_start"], 30, "the first answer")  # type: ignore[operator]
    text = request("GET", f"http://127.0.0.1:{fleet.admin_port}/metrics").text
    for stage in ("process_start", "health_pass", "model_loaded", "first_byte", "total"):
        assert f'wakegate_cold_start_seconds_count{{model="llama",stage="{stage}"}}' in text, stage


LEAST_LOADED = """---
apiVersion: wakegate.io/v1alpha1
kind: Model
metadata: {name: pair}
spec:
  backend: llamacpp
  source: file://tiny.gguf
  args: [--threads, "1", --parallel, "1", --ctx-size, "2048"]
  routing: {strategy: least-loaded}
  scaling: {min: 2, max: 2}
"""


def test_least_loaded_avoids_the_replica_its_metrics_say_is_busy(
    tmp_path: Path, tiny: TinyFiles, llama_server_bin: Path
) -> None:
    shutil.copy(tiny.model, tmp_path / "tiny.gguf")
    up = UpProcess(tmp_path, LEAST_LOADED, env=engines_path(llama_server_bin))
    stop = threading.Event()
    try:
        up.wait_ready({"pair": 2}, timeout=120)
        busy, idle = sorted(up.endpoints("pair"))
        # Traffic the gateway never sees: long generations sent straight to one replica. Only
        # llama-server's own metrics (requests_processing, requests_deferred) can tell the gateway.

        def keep_busy() -> None:
            while not stop.is_set():
                try:
                    request(
                        "POST",
                        f"http://{busy}/v1/completions",
                        timeout=120,
                        body={"prompt": "tell me a story", "max_tokens": 1500, "cache_prompt": False},
                    )
                except OSError:
                    return  # the engine stopped with the test

        workers = [threading.Thread(target=keep_busy, daemon=True) for _ in range(3)]
        for worker in workers:
            worker.start()

        def busy_seen() -> bool:
            replicas = model_status(up, "pair")["replicas"]
            loads = {f"127.0.0.1:{r['port']}": r["engine_load"] for r in replicas}  # type: ignore[index]
            load = loads.get(busy)
            return bool(load) and load["running"] + load["waiting"] >= 2  # type: ignore[index]

        wait_for(busy_seen, 30, "the busy replica's metrics to show its queue")
        upstreams = []
        for _ in range(8):
            reply = request(
                "POST",
                f"{up.base_url}/chat/completions",
                timeout=60,
                body={"model": "pair", "messages": PROMPT, "max_tokens": 2},
            )
            assert reply.status == 200, reply.text
            upstreams.append(reply.headers["x-wakegate-upstream"])
        # The gateway's own in-flight counts are equal (0) for both at every pick; without the
        # engine's metrics these requests would alternate.
        assert set(upstreams) == {idle}, upstreams
    finally:
        stop.set()
        assert up.stop() == 0, up.log()
