"""The I/O side of a backend plugin for `wakegate up`: one engine process's HTTP conversation.

The plugin (control/backends/) says what to ask; this module asks it over loopback: health, the
load steps (Ollama's blob upload, create and preload), the checks that the model is loaded, one
token through the OpenAI API, and the engine's own load signals. `runnable()` is the check made
when the manifest is read: the engine's executable exists, so a Model that cannot start is
refused before anything starts.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

import aiohttp

from wakegate.control.backends import BACKENDS, Backend, HttpStep, LoadSignals, fill, fill_json
from wakegate.control.schema import Model

#: The one-token request that proves the model answers (and warms its first request).
ANSWER_PROMPT = "hello"


class EngineError(Exception):
    """The engine did not do what a load step asked; the message is for status and logs."""


def runnable(model: Model, base_dir: Path) -> str | None:
    """Why this machine cannot start `model`'s engine, or None when it can: its executable is
    missing, or its `file://` weights (relative ones from `base_dir`) do not exist."""
    backend = BACKENDS[model.spec.backend]
    source = model.spec.source or ""
    if source.startswith("file://"):
        path = base_dir / source.removeprefix("file://")  # an absolute path replaces base_dir
        if not path.exists():
            return f"spec.source {source}: {path} does not exist"
        if backend.needs_file and not path.is_file():
            return f"spec.source {source}: backend {backend.name} loads one file, and {path} is a folder"
    program = tuple(model.spec.command) or backend.program
    if not program:
        return f"backend {backend.name} has no standard command: set spec.command"
    if shutil.which(program[0]) is None:
        return (
            f"backend {backend.name}: {program[0]!r} is not an executable on PATH; install it or set "
            "spec.command to its path"
        )
    return None


_DIGESTS: dict[tuple[str, int, int], str] = {}


def _sha256(path: Path) -> str:
    """The file's SHA-256, remembered per (path, size, mtime): a 4 GB GGUF is hashed once."""
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]


class Engine:
    """One engine process on `host:port`, as its plugin describes it."""

    def __init__(
        self,
        backend: Backend,
        session: aiohttp.ClientSession,
        host: str,
        port: int,
        values: Mapping[str, str],
        model_file: Path | None,
    ) -> None:
        self.backend = backend
        self.session = session
        self.base = f"http://{host}:{port}"
        self.values = dict(values)
        self.model_file = model_file

    async def healthy(self) -> bool:
        status, _ = await self._get(self.backend.health_path, timeout=2.0)
        return status == 200

    async def prepare(self) -> None:
        """Run the plugin's load steps in order (Ollama: upload, create, load)."""
        if self.backend.prepare and self.model_file is not None and "sha256" not in self.values:
            self.values["sha256"] = await asyncio.to_thread(_sha256, self.model_file)
        for step in self.backend.prepare:
            await self._step(step)

    async def loaded(self) -> bool:
        """Every plugin check that the model is loaded passes."""
        for step in self.backend.loaded:
            try:
                await self._step(step)
            except EngineError:
                return False
        return True

    async def sleep(self, level: int) -> None:
        """Put the engine to sleep at `level` and check that it sleeps (raises EngineError)."""
        self.values["sleep_level"] = str(level)
        for step in self.backend.sleep:
            await self._step(step)
        await self._until(self.backend.asleep, 30.0)

    async def _until(self, checks: tuple[HttpStep, ...], timeout: float) -> None:
        """Repeat `checks` until they all pass (an engine lets go of a model in the background);
        the last failure after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                for step in checks:
                    await self._step(step)
                return
            except EngineError:
                if time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.05)

    async def wake(self, level: int) -> None:
        """Wake the engine from `level` and check that it is awake (raises EngineError)."""
        self.values["sleep_level"] = str(level)
        for step in self.backend.wake_steps(level):
            await self._step(step)
        await self._until(self.backend.awake, 30.0)

    async def answer(self) -> float:
        """One token through the OpenAI API; returns seconds to the answer's first byte."""
        started = time.monotonic()
        # A chat request, like the ones that follow: Ollama sometimes reloaded its runner when the
        # first request was a plain completion and the next a chat (a second load, ~350 ms).
        body = {
            "model": self.values["served_name"],
            "messages": [{"role": "user", "content": ANSWER_PROMPT}],
            "max_tokens": 1,
            "temperature": 0,
        }
        url = f"{self.base}{self.backend.openai_prefix}/chat/completions"
        try:
            async with self.session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=120)) as response:
                await response.content.read(1)
                first = time.monotonic() - started
                rest = await response.read()
                if response.status != 200:
                    raise EngineError(f"the model did not answer: HTTP {response.status} {rest[:200]!r}")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise EngineError(f"the model did not answer: {exc or type(exc).__name__}") from None
        return first

    async def load(self) -> LoadSignals | None:
        """The engine's own load signals (None: it reports none, or did not answer)."""
        metrics = self.backend.load_metrics
        if metrics is None:
            return None
        status, text = await self._get(self.backend.metrics_path, timeout=2.0)
        return metrics.parse(text.decode("utf-8", "replace")) if status == 200 else None

    # -- HTTP -------------------------------------------------------------------------------------

    async def _get(self, path: str, timeout: float) -> tuple[int, bytes]:
        try:
            async with self.session.get(self.base + path, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                return response.status, await response.read()
        except (aiohttp.ClientError, TimeoutError, OSError):
            return 0, b""

    async def _step(self, step: HttpStep) -> None:
        path = fill(step.path, self.values)
        what = step.what or f"{step.method} {path}"
        timeout = aiohttp.ClientTimeout(total=step.timeout)
        try:
            if step.upload_model:
                if self.model_file is None:
                    raise EngineError(f"{what}: the model has no weight file")
                async with self.session.head(self.base + path, timeout=timeout) as response:
                    if response.status == 200:
                        return  # this replica's store already holds the blob
                with open(self.model_file, "rb") as handle:
                    async with self.session.post(self.base + path, data=handle, timeout=timeout) as response:
                        status, body = response.status, await response.read()
            elif step.method == "GET":
                async with self.session.get(self.base + path, timeout=timeout) as response:
                    status, body = response.status, await response.read()
            else:
                payload = fill_json(dict(step.body or {}), self.values)
                async with self.session.post(self.base + path, json=payload, timeout=timeout) as response:
                    status, body = response.status, await response.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise EngineError(f"{what}: {exc or type(exc).__name__}") from None
        if status >= 300:
            raise EngineError(f"{what}: HTTP {status} {_excerpt(body)}")
        text = body.decode("utf-8", "replace")
        if step.contains and fill(step.contains, self.values) not in text:
            raise EngineError(f"{what}: not yet")
        if step.lacks and fill(step.lacks, self.values) in text:
            raise EngineError(f"{what}: not yet")


def _excerpt(body: bytes) -> str:
    try:
        parsed = json.loads(body)
    except ValueError:
        return body[:200].decode("utf-8", "replace")
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), str | dict):
        return json.dumps(parsed["error"])[:200]
    return body[:200].decode("utf-8", "replace")
