"""Real engines for tests: llama-server and ollama built by `e2e.engines`, serving a GGUF
that `e2e.tinymodel` generates; vLLM installed by `e2e.engines`, serving a Hugging Face folder
that `e2e.hfmodel` generates.

`llama_server_bin` / `ollama_bin` / `vllm_bin` build (install) or reuse the engine (a test that needs one is skipped,
with the reason, on a machine without its toolchain; CI has them). `start_llama_server(...)`
and `start_ollama(...)` start one on a free loopback port and wait until it answers;
`EngineProcess.stop()` sends SIGTERM and reports the exit status. `chat(...)` / `greedy(...)`
send the same greedy chat completion through the official openai client to either engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from openai.types import CompletionUsage

from e2e import engines, hfmodel
from e2e.tinymodel import ModelSpec, write_lora, write_model
from tests.support.processes import stop_process
from tests.support.required import missing
from tests.support.sim import http_status
from wakegate.control.admin import free_port

PROMPT = [{"role": "user", "content": "tell me about the weather"}]


def engine_binary(name: str) -> Path:
    try:
        return engines.ensure(name)
    except engines.ToolchainMissing as exc:
        missing(str(exc))


@pytest.fixture(scope="session")
def llama_server_bin() -> Path:
    return engine_binary("llama-server")


@pytest.fixture(scope="session")
def ollama_bin() -> Path:
    return engine_binary("ollama")


@pytest.fixture(scope="session")
def vllm_bin() -> Path:
    """The `vllm` script of the cached install (minutes the first time on a machine)."""
    return engine_binary("vllm")


@dataclass(frozen=True)
class HFTiny:
    """A generated Hugging Face model folder and two PEFT adapter folders for it."""

    model: Path
    sql: Path
    poet: Path


@pytest.fixture(scope="session")
def hf_tiny(tmp_path_factory: pytest.TempPathFactory) -> HFTiny:
    folder = tmp_path_factory.mktemp("hfmodel")
    spec = hfmodel.HFModelSpec(seed=0)
    return HFTiny(
        model=hfmodel.write_model(folder / "tiny", spec),
        sql=hfmodel.write_lora(folder / "sql", spec, seed=11),
        poet=hfmodel.write_lora(folder / "poet", spec, seed=12),
    )


#: vLLM on a small CPU: float32 (the generated weights' type), a context that fits the tiny
#: KV cache, and no torch.compile (eager starts tens of seconds sooner; docs/decisions.md).
VLLM_ARGS = ("--dtype", "float32", "--max-model-len", "512", "--enforce-eager")


#: The tiny GGUF on llama-server as a Model's spec (no scaling), from `weights/tiny.gguf` beside the manifest.
TINY_LLAMA = {
    "backend": "llamacpp",
    "servedName": "org/tiny-llama",
    "source": "file://weights/tiny.gguf",
    "args": ["--threads", "1", "--ctx-size", "512"],
}


@dataclass(frozen=True)
class TinyFiles:
    model: Path
    other_seed: Path
    lora: Path


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyFiles:
    """The default generated model (seed 0), the same shape from seed 1, and a LoRA for the first."""
    folder = tmp_path_factory.mktemp("tinymodel")
    return TinyFiles(
        model=write_model(folder / "tiny.gguf", ModelSpec(seed=0)),
        other_seed=write_model(folder / "tiny-seed1.gguf", ModelSpec(seed=1)),
        lora=write_lora(folder / "tiny-lora.gguf", ModelSpec(seed=0)),
    )


class EngineProcess:
    """An engine process on 127.0.0.1:`port`, its output kept in a temporary file."""

    def __init__(self, argv: list[str], port: int, env: dict[str, str] | None = None) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def wait_until(self, ok: Callable[[], bool], what: str, timeout: float = 60.0) -> float:
        """Poll `ok` until true; returns the seconds since start. Fails with the engine's log."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {self.proc.returncode} before {what}:\n{self.log()}")
            if ok():
                return time.monotonic() - self.started
            time.sleep(0.01)
        raise TimeoutError(f"engine not {what} after {timeout}s:\n{self.log()}")

    def get_json(self, path: str, timeout: float = 10.0) -> Any:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=timeout) as resp:
            return json.loads(resp.read())

    def post_json(self, path: str, body: object, timeout: float = 60.0) -> Any:
        request = urllib.request.Request(
            f"{self.url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then SIGKILL if it does not exit in time; returns the exit status."""
        return stop_process(self.proc, self._log, timeout=timeout)


@dataclass(frozen=True)
class Reply:
    text: str
    pieces: int
    finish_reason: str | None
    usage: CompletionUsage | None
    model: str


def chat(
    server: EngineProcess, model: str = "tiny", max_tokens: int = 8, stream: bool = False, **extra: object
) -> Reply:
    """A greedy chat completion of PROMPT through the official openai client; `extra` goes into
    the body (llama-server's `lora`, `cache_prompt`)."""
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    request: dict[str, Any] = {
        "model": model,
        "messages": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "seed": 7,
        "extra_body": extra or None,
    }
    if not stream:
        reply = client.chat.completions.create(**request)
        choice = reply.choices[0]
        return Reply(choice.message.content or "", 1, choice.finish_reason, reply.usage, reply.model)
    pieces: list[str] = []
    usage, finish_reason, served = None, None, ""
    for chunk in client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}):
        served = chunk.model
        if chunk.choices:
            pieces += [chunk.choices[0].delta.content] if chunk.choices[0].delta.content else []
            finish_reason = chunk.choices[0].finish_reason or finish_reason
        usage = chunk.usage or usage
    return Reply("".join(pieces), len(pieces), finish_reason, usage, served)


def greedy(server: EngineProcess, max_tokens: int = 8, model: str = "tiny", **extra: object) -> str:
    return chat(server, model=model, max_tokens=max_tokens, **extra).text


def start_engine(
    argv: list[str], port: int, health: str, env: dict[str, str] | None = None, timeout: float = 60.0
) -> EngineProcess:
    """Start an engine and wait until GET `health` answers 200 (stopping it if that fails)."""
    server = EngineProcess(argv, port, env)
    try:
        server.wait_until(
            lambda: http_status(f"{server.url}{health}", timeout=0.5) == 200, f"answering {health}", timeout
        )
    except BaseException:
        server.stop()
        raise
    return server


def start_llama_server(binary: Path, model: Path, *args: str, alias: str = "tiny") -> EngineProcess:
    """llama-server serving `model` as `alias`, with metrics; returns once /health says ok."""
    port = free_port()
    argv = [
        str(binary),
        "--model",
        str(model),
        "--alias",
        alias,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--metrics",
        "--threads",
        "1",
        "--ctx-size",
        "512",
        *args,
    ]
    return start_engine(argv, port, "/health")


def ollama_env(port: int, home: Path) -> dict[str, str]:
    """An `ollama serve` of its own: its port, models folder and home; no cloud, never idles out."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "OLLAMA_HOST": f"127.0.0.1:{port}",
        "OLLAMA_MODELS": str(home / "models"),
        "OLLAMA_KEEP_ALIVE": "-1",
        "OLLAMA_NO_CLOUD": "1",
        "OLLAMA_NUM_PARALLEL": "1",
        "OLLAMA_CONTEXT_LENGTH": "512",
    }


def start_ollama(binary: Path, home: Path) -> EngineProcess:
    """`ollama serve` on a free port with its own home; returns once /api/version answers."""
    port = free_port()
    home.mkdir(parents=True, exist_ok=True)
    return start_engine([str(binary), "serve"], port, "/api/version", env=ollama_env(port, home))


def ollama_create(binary: Path, server: EngineProcess, home: Path, name: str, modelfile: str) -> None:
    """`ollama create NAME -f Modelfile` against `server` (the CLI talks to OLLAMA_HOST)."""
    path = home / f"{name.replace(':', '_')}.Modelfile"
    path.write_text(modelfile)
    out = subprocess.run(
        [str(binary), "create", name, "-f", str(path)],
        env=ollama_env(server.port, home),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, f"ollama create failed:\n{out.stdout}\n{out.stderr}\n{server.log()}"


@pytest.fixture(scope="module")
def llama_server(llama_server_bin: Path, tiny: TinyFiles) -> Iterator[EngineProcess]:
    """llama-server with the tiny model (no adapter)."""
    server = start_llama_server(llama_server_bin, tiny.model)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ollama(ollama_bin: Path, tiny: TinyFiles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """`ollama serve` with models created from the local GGUFs: `tiny`, `tiny-seed1` (the seed-1
    sibling) and `tiny-lora` (`tiny` with the LoRA adapter)."""
    home = tmp_path_factory.mktemp("ollama")
    server = start_ollama(ollama_bin, home)
    try:
        ollama_create(ollama_bin, server, home, "tiny", f"FROM {tiny.model}\n")
        ollama_create(ollama_bin, server, home, "tiny-seed1", f"FROM {tiny.other_seed}\n")
        ollama_create(ollama_bin, server, home, "tiny-lora", f"FROM {tiny.model}\nADAPTER {tiny.lora}\n")
        yield server
    finally:
        server.stop()


def vllm_model(routing: str, scaling: str, extra: str = "") -> str:
    """A `backend: vllm` Model document named tiny over `file://weights/tiny` with VLLM_ARGS;
    `extra` is more spec lines (two-space indented)."""
    return f"""---
apiVersion: wakegate.io/v1alpha1
kind: Model
metadata: {{name: tiny}}
spec:
  backend: vllm
  servedName: org/tiny-hf
  source: file://weights/tiny
  args: {json.dumps(list(VLLM_ARGS))}
{extra}  routing: {routing}
  scaling: {scaling}
"""
