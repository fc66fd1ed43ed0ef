"""Ollama's asleep tier under `wakegate up`: a Model with `scaling.sleepAfter` idles to asleep (the
`ollama serve` process lives, the model is unloaded from it: /api/ps no longer lists it) and the
next request is answered by the same process after a reload, beside a Model of the same GGUF that
idles to zero and starts again. How much faster the asleep wake is: tests/bench/bench_sleep.py."""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.engines.conftest import PROMPT, TinyFiles
from tests.engines.test_up_engines import engines_path
from tests.support.http import request
from tests.support.up import UpProcess, model_doc, pids_alive
from tests.support.waiting import wait_for


def ollama_doc(name: str, scaling: str) -> str:
    """An Ollama Model on the generated GGUF with `scaling`."""
    return model_doc(
        name,
        backend="ollama",
        extra=f"""  source: file://weights/tiny.gguf
  env: {{OLLAMA_NUM_PARALLEL: "1", OLLAMA_CONTEXT_LENGTH: "512"}}
  scaling: {{{scaling}}}
""",
    )


#: One idles to asleep after 1 s (and to zero only after 10 minutes), the other to zero after 2 s.
FLEET = ollama_doc("sleepy", "min: 0, max: 1, sleepAfter: 1, idleTimeout: 600, activationTimeout: 120") + ollama_doc(
    "zeroed", "min: 0, max: 1, idleTimeout: 2, activationTimeout: 120"
)


def ask(up: UpProcess, model: str) -> float:
    """Seconds to the answer of one short chat completion through the gateway."""
    started = time.monotonic()
    body = {"model": model, "messages": PROMPT, "max_tokens": 2, "temperature": 0}
    response = request("POST", f"{up.base_url}/chat/completions", body=body, timeout=120)
    assert response.status == 200, response.body
    return time.monotonic() - started


def model_status(up: UpProcess, key: str) -> dict[str, Any]:
    return next(m for m in up.status()["models"] if m["key"] == key)


def loaded_models(port: int) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/ps", timeout=5) as response:
        return [m["name"] for m in json.loads(response.read())["models"]]


def start_fleet(tmp: Path, tiny: TinyFiles, ollama_bin: Path) -> UpProcess:
    (tmp / "weights").mkdir()
    shutil.copy(tiny.model, tmp / "weights" / "tiny.gguf")
    up = UpProcess(tmp, FLEET, env=engines_path(ollama_bin))
    up.wait_ready({}, timeout=90)
    return up


def test_ollama_idles_to_asleep_and_wakes_in_the_same_process(
    tmp_path: Path, tiny: TinyFiles, ollama_bin: Path
) -> None:
    up = start_fleet(tmp_path, tiny, ollama_bin)
    try:
        ask(up, "sleepy")
        ask(up, "zeroed")
        (replica,) = model_status(up, "sleepy")["replicas"]
        assert loaded_models(replica["port"]) == ["sleepy:latest"]
        wait_for(lambda: model_status(up, "sleepy")["tier"] == "asleep", 60, "sleepy asleep")
        wait_for(lambda: model_status(up, "zeroed")["tier"] == "zero", 60, "zeroed at zero")
        # Asleep: the process lives, the model is unloaded, nothing routes to it.
        status = model_status(up, "sleepy")
        assert status["ready"] == 0 and status["replicas"][0]["pid"] == replica["pid"]
        assert pids_alive([replica["pid"]]) == [replica["pid"]] and loaded_models(replica["port"]) == []

        ask(up, "sleepy")
        ask(up, "zeroed")
        status = model_status(up, "sleepy")
        assert status["tier"] == "warm" and status["replicas"][0]["pid"] == replica["pid"]
        assert loaded_models(replica["port"]) == ["sleepy:latest"]
        # A wake is booked as its replica turns ready, which can trail the answer it released.
        def wakes() -> dict[str, Any]:
            return up.status()["savings"]["models"]  # type: ignore[no-any-return]

        wait_for(lambda: wakes()["zeroed"]["wakes"]["zero"]["count"] >= 2, 15, "both wakes booked")
        booked = wakes()
        assert booked["sleepy"]["wakes"]["asleep"]["count"] == 1
        assert booked["zeroed"]["wakes"]["zero"]["count"] == 2 and booked["zeroed"]["wakes"]["asleep"]["count"] == 0
    finally:
        assert up.stop() == 0, up.log()
