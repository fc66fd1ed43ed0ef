"""Cold start of real engines: through wakegate vs the same engine started by hand.

Run from the repository root (not collected by `pytest tests`):

    python -m tests.bench.bench_engines [--runs 10] [--engines llamacpp,ollama,vllm] [--json OUT]
                                        [--dim 64 --layers 2]

For each engine, on one generated GGUF (e2e/tinymodel.py; `--dim/--layers` for a bigger one) or,
for vLLM, one generated Hugging Face folder (e2e/hfmodel.py, its default shape), alternating run
by run in one process so both sides see the same machine load:

* by hand: the engine's own command (the same argv and environment the plugin renders, e.g.
  `llama-server --model F --alias N --host 127.0.0.1 --port P --metrics --threads 1`), its
  health polled every 5 ms, then the request sent straight to it. For Ollama the model was
  created in its store once beforehand (as on a machine that has it), so by hand it is `ollama
  serve`, `/api/version`, then the request, which loads the model.
* through wakegate: one `wakegate up` with the engine as a `min: 0` Model (`idleTimeout: 1`);
  each run waits until the engine process is gone, then sends the request to the gateway.

The request is the same streamed chat completion (8 tokens, temperature 0) through the official
openai client; time to first token (TTFT) is from the engine's spawn (by hand) or from the
request's send (wakegate) to the first content chunk. wakegate's added cold start = p50 TTFT
through wakegate - p50 TTFT by hand. /status's timeline of each wakegate run (activation ->
process start -> health -> [Ollama: load steps, first answer] -> model loaded -> ready, then the
engine's first answer to wakegate's own check for llama.cpp) says where it goes.

Paired, for engines whose own start varies by more than the target (vLLM's moves by seconds
from run to run): each wakegate run also watches its engine from outside, as the by-hand run
does, with the same 5 ms polls: when `/status` first lists the replica's process (the spawn)
and when the engine's health first passes. wakegate's added cold start is then what lies
outside the engine's own start: send -> spawn, plus health -> first token through wakegate
minus health -> first token by hand (p50 of each), so the engine's start, the same process in
both paths, drops out of the difference.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from openai import OpenAI

from e2e import engines, hfmodel
from e2e.tinymodel import ModelSpec, write_model
from tests.bench.common import git_state, loadavg
from tests.support.up import UpProcess, pids_alive
from wakegate.control.admin import free_port
from wakegate.control.backends import BACKENDS

PROMPT = [{"role": "user", "content": "tell me about the weather"}]
ARGS = {
    "llamacpp": ["--threads", "1"],
    "ollama": [],
    # as tests/engines runs it: float32, a small context, no torch.compile (docs/decisions.md)
    "vllm": ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager"],
}
ENV: dict[str, dict[str, str]] = {"llamacpp": {}, "ollama": {"OLLAMA_NUM_PARALLEL": "1"}, "vllm": {}}
BINARY = {"llamacpp": "llama-server", "ollama": "ollama", "vllm": "vllm"}
#: seconds a cold start may take (vLLM's is about a minute on two cores)
START_TIMEOUT = {"llamacpp": 60.0, "ollama": 60.0, "vllm": 400.0}


def ttft(base_url: str, model: str, timeout: float = 120.0) -> tuple[float, int]:
    """Seconds from now to the first content chunk of the streamed request; and the chunk count."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=timeout)
    started = time.monotonic()
    first = None
    chunks = 0
    for chunk in client.chat.completions.create(
        model=model,
        messages=PROMPT,
        max_tokens=8,  # type: ignore[arg-type]
        temperature=0,
        stream=True,
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            chunks += 1
            if first is None:
                first = time.monotonic() - started
    if first is None:
        raise RuntimeError("no content")
    return first, chunks


def http_ok(url: str, timeout: float = 0.5) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def prepare_ollama_store(binary: Path, model: Path, state: Path) -> None:
    """Create `tiny` once in the store the by-hand runs use."""
    port = free_port()
    values = {"host": "127.0.0.1", "port": str(port), "model": str(model), "served_name": "tiny", "state": str(state)}
    env = dict(os.environ, **BACKENDS["ollama"].environment(values))
    proc = subprocess.Popen(
        [str(binary), "serve"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True
    )
    try:
        while not http_ok(f"http://127.0.0.1:{port}/api/version"):
            time.sleep(0.02)
        modelfile = state / "Modelfile"
        modelfile.write_text(f"FROM {model}\n")
        subprocess.run(
            [str(binary), "create", "tiny", "-f", str(modelfile)], env=env, check=True, capture_output=True, timeout=120
        )
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50_ms": statistics.median(values) * 1000,
        "p90_ms": pct(values, 0.9) * 1000,
        "min_ms": min(values) * 1000,
        "max_ms": max(values) * 1000,
    }


def bench_engine(name: str, binary: Path, model: Path, runs: int, tmp: Path) -> dict[str, Any]:
    folder = tmp / name
    folder.mkdir()
    hand_state = folder / "hand"
    hand_state.mkdir()
    if name == "ollama":
        prepare_ollama_store(binary, model, hand_state)
    manifest = f"""apiVersion: wakegate.io/v1alpha1
kind: Model
metadata: {{name: tiny}}
spec:
  backend: {name}
  source: file://{model}
  args: {json.dumps(ARGS[name])}
  env: {json.dumps(ENV[name])}
  scaling: {{min: 0, max: 1, idleTimeout: 1, activationTimeout: {int(START_TIMEOUT[name])}}}
"""
    up = UpProcess(folder, manifest, env={"PATH": f"{binary.parent}{os.pathsep}{os.environ['PATH']}"})
    hand: list[float] = []
    gate: list[float] = []
    hand_after: list[float] = []  # by hand: health -> first token
    gate_spawn: list[float] = []  # through wakegate: send -> the process exists
    gate_after: list[float] = []  # through wakegate: health -> first token
    timelines: list[dict[str, float]] = []
    try:
        up.wait_ready({"tiny": 0}, timeout=120)
        pids: list[int] = []
        for _ in range(runs):
            total, after = spawn_to_first_token(name, binary, model, hand_state)
            hand.append(total)
            hand_after.append(after)
            # A cold start from idle: the previous engine process has exited (a request that
            # arrives while it is still being stopped waits for that stop first).
            deadline = time.monotonic() + 120
            while True:
                (status,) = [m for m in up.status()["models"] if m["key"] == "tiny"]
                if not status["replicas"] and status["state"] == "idle" and not pids_alive(pids):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("the engine did not go back to zero")
                time.sleep(0.05)
            watch = EngineWatch(up, BACKENDS[name].health_path)
            watch.start()
            first, _ = ttft(up.base_url, "tiny", START_TIMEOUT[name])
            watch.join(START_TIMEOUT[name])
            gate.append(first)
            if watch.spawned is not None and watch.healthy is not None:
                gate_spawn.append(watch.spawned)
                gate_after.append(first - watch.healthy)
            # The engine's first answer to wakegate's own check comes after the held request
            # (engines that get one: not vLLM, whose /health passes once the model is loaded).
            until = time.monotonic() + (10 if BACKENDS[name].answer_probe else 0)
            while True:
                (status,) = [m for m in up.status()["models"] if m["key"] == "tiny"]
                if "first_byte" in status["last_cold_start"] or time.monotonic() > until:
                    break
                time.sleep(0.05)
            timelines.append(dict(status["last_cold_start"]))
            pids = [int(r["pid"]) for r in status["replicas"] if r["pid"]]
    finally:
        up.stop()
    stages = sorted({k for t in timelines for k in t})
    added = statistics.median(gate) - statistics.median(hand)
    paired = (
        statistics.median(gate_spawn) + statistics.median(gate_after) - statistics.median(hand_after)
        if gate_after
        else float("nan")
    )
    return {
        "by_hand": summary(hand),
        "wakegate": summary(gate),
        "added_p50_ms": added * 1000,
        "paired": {
            "send_to_spawn": summary(gate_spawn) if gate_spawn else {},
            "health_to_first_token_wakegate": summary(gate_after) if gate_after else {},
            "health_to_first_token_by_hand": summary(hand_after),
            "added_p50_ms": paired * 1000,
        },
        "timeline_p50_ms": {k: statistics.median([t[k] for t in timelines if k in t]) * 1000 for k in stages},
        "raw": {"by_hand": hand, "wakegate": gate, "hand_after": hand_after, "gate_spawn": gate_spawn,
                "gate_after": gate_after},
    }


class EngineWatch(threading.Thread):
    """During one wakegate run, from outside: seconds from its start until `/status` lists the
    replica's process (``spawned``) and until the engine's health first passes (``healthy``),
    each polled every 5 ms as the by-hand run polls."""

    def __init__(self, up: UpProcess, health_path: str, timeout: float = 600.0) -> None:
        super().__init__(daemon=True)
        self.up, self.health_path, self.timeout = up, health_path, timeout
        self.started = time.monotonic()
        self.spawned: float | None = None
        self.healthy: float | None = None

    def run(self) -> None:
        # Each time is when the poll that first saw it was sent (a reply slowed by a busy machine
        # does not move it), as the by-hand run times its health.
        deadline = self.started + self.timeout
        port = None
        while port is None and time.monotonic() < deadline:
            asked = time.monotonic()
            (status,) = [m for m in self.up.status()["models"] if m["key"] == "tiny"]
            live = [r for r in status["replicas"] if r.get("pid") and r.get("port")]
            if live:
                self.spawned = asked - self.started
                port = int(live[0]["port"])
            else:
                time.sleep(0.005)
        while port is not None and time.monotonic() < deadline:
            asked = time.monotonic()
            if http_ok(f"http://127.0.0.1:{port}{self.health_path}", timeout=5.0):
                self.healthy = asked - self.started
                return
            time.sleep(0.005)


def spawn_to_first_token(name: str, binary: Path, model: Path, state: Path) -> tuple[float, float]:
    """By hand: seconds from the spawn to the first token, and from health passing to it."""
    backend = BACKENDS[name]
    port = free_port()
    values = {"host": "127.0.0.1", "port": str(port), "model": str(model), "served_name": "tiny", "state": str(state)}
    argv = [str(binary), *backend.command(values)[1:], *ARGS[name]]
    env = dict(os.environ, **backend.environment(values), **ENV[name])
    deadline = time.monotonic() + START_TIMEOUT[name]
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        while True:
            asked = time.monotonic()
            if http_ok(f"http://127.0.0.1:{port}{backend.health_path}", timeout=5.0):
                break
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not pass its health check in {START_TIMEOUT[name]:.0f} s")
            time.sleep(0.005)
        sent = time.monotonic()
        first, _ = ttft(f"http://127.0.0.1:{port}/v1", "tiny")
        return sent - started + first, sent - asked + first
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--engines", default="llamacpp,ollama")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    try:
        model = write_model(tmp / "tiny.gguf", ModelSpec(dim=args.dim, layers=args.layers))
        folder = hfmodel.write_model(tmp / "tiny-hf")
        result: dict[str, Any] = {
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "git": git_state(),
            "loadavg_before": loadavg(),
            "model_bytes": model.stat().st_size,
            "engines": {},
        }
        for name in args.engines.split(","):
            binary = engines.ensure(BINARY[name])
            weights = folder if BACKENDS[name].loads_folder else model
            result["engines"][name] = bench_engine(name, binary, weights, args.runs, tmp)
            res = result["engines"][name]
            stages = json.dumps({k: round(v) for k, v in res["timeline_p50_ms"].items()})
            print(
                f"{name}: by hand p50 {res['by_hand']['p50_ms']:.0f} ms, through wakegate p50 "
                f"{res['wakegate']['p50_ms']:.0f} ms, added {res['added_p50_ms']:.0f} ms "
                f"(paired: {res['paired']['added_p50_ms']:.0f} ms); "
                f"timeline p50 (ms since activation) {stages}",
                flush=True,
            )
        result["loadavg_after"] = loadavg()
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
