"""The operator's LoRA I/O for engines that load adapters at run time (vLLM's `--enable-lora`).

Each reconcile of such a base hands :meth:`RuntimeLoader.sync` the base's pods whose containers
are ready (the pods' readiness gate opens once they hold their adapters) and the
adapters it serves (at most `spec.adapters.maxAdapters`, so every pod holds all of them); the
loader posts `POST /v1/load_lora_adapter {lora_name, lora_path}` for each one a pod lacks and
`POST /v1/unload_lora_adapter {lora_name}` for each one it holds that is no longer served. An
engine that answers "already been loaded" holds it (an operator that restarted forgets what it
loaded). What each pod holds lives in memory, keyed by pod uid, and goes with the pod.
llama.cpp bases need none of this: their pods start with every adapter (operator/render.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from wakegate.control.k8s.objects import rfc3339_now

log = logging.getLogger("wakegate.operator.lora")

#: Seconds one load or unload may take (a load reads the adapter's weights).
CALL_TIMEOUT = 30.0


@dataclass(frozen=True)
class Wanted:
    """One adapter a base's pods should hold: its object name, the engine's name, the path in the pod."""

    name: str
    served_name: str
    path: str


@dataclass
class _Held:
    served_name: str
    path: str
    since: str


@dataclass
class RuntimeLoader:
    """What each pod of the run-time-loading bases holds, and the calls that keep it so."""

    #: pod uid -> adapter object key ("namespace/name") -> what is loaded there
    held: dict[str, dict[str, _Held]] = field(default_factory=dict)
    #: pod uid -> pod name, for status
    pod_names: dict[str, str] = field(default_factory=dict)
    #: pod uid -> the key ("namespace/name") of the Model it serves
    bases: dict[str, str] = field(default_factory=dict)
    #: adapter key -> the engine's answer to its last refused load (cleared by a load that works)
    failures: dict[str, str] = field(default_factory=dict)
    #: adapter key -> refused loads not yet counted in its status
    new_failures: dict[str, int] = field(default_factory=dict)
    #: one sync at a time per base (two workers may reconcile one Model back to back)
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    def holders(self, key: str) -> dict[str, str]:
        """Pods holding adapter `key` -> when it was loaded there."""
        return {self.pod_names[uid]: h[key].since for uid, h in self.held.items() if key in h}

    def synced(self, base: str) -> set[str]:
        """The pods of `base` whose engine was given every adapter wanted at the last sync."""
        return {self.pod_names[uid] for uid, b in self.bases.items() if b == base}

    def forget(self, base: str) -> None:
        """The Model `base` is gone, and its pods with it."""
        for uid in [u for u, b in self.bases.items() if b == base]:
            for memory in (self.held, self.pod_names, self.bases):
                memory.pop(uid, None)
        self._locks.pop(base, None)

    def take_failures(self, key: str) -> int:
        return self.new_failures.pop(key, 0)

    async def sync(self, base: str, pods: Sequence[Mapping[str, Any]], wanted: Sequence[Wanted],
                   ready: Mapping[str, str]) -> bool:
        """Make every pod of the Model `base` ("namespace/name") whose engine answers (`ready`: pod
        names; their readiness gate waits for this) hold exactly `wanted`; forget its pods that are
        gone or not ready. True when some pod's adapters changed."""
        async with self._locks.setdefault(base, asyncio.Lock()):
            return await self._sync(base, pods, wanted, ready)

    async def _sync(self, base: str, pods: Sequence[Mapping[str, Any]], wanted: Sequence[Wanted],
                    ready: Mapping[str, str]) -> bool:
        namespace = base.partition("/")[0]
        live: dict[str, tuple[str, str]] = {}
        for pod in pods:
            meta = pod["metadata"]
            ip = (pod.get("status") or {}).get("podIP")
            port = _http_port(pod)
            if meta["name"] in ready and ip and port:
                live[str(meta["uid"])] = (str(meta["name"]), f"{ip}:{port}")
        gone = [u for u, b in self.bases.items() if b == base and u not in live]
        for uid in gone:
            for memory in (self.held, self.pod_names, self.bases):
                memory.pop(uid, None)
        changed = bool(gone)
        for uid, (name, _) in live.items():
            self.pod_names[uid], self.bases[uid] = name, base
        want = {f"{namespace}/{w.name}": w for w in wanted}
        work = [(uid, where) for uid, where in live.items()
                if {k: (h.served_name, h.path) for k, h in self.held.get(uid, {}).items()}
                != {k: (w.served_name, w.path) for k, w in want.items()}]
        if not work:
            return changed
        timeout = aiohttp.ClientTimeout(total=CALL_TIMEOUT)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for uid, (name, endpoint) in work:
                held = self.held.setdefault(uid, {})
                for key, h in list(held.items()):
                    target = want.get(key)
                    if target is None or (target.served_name, target.path) != (h.served_name, h.path):
                        await self._unload(session, endpoint, name, h.served_name)
                        del held[key]
                        changed = True
                for key, w in want.items():
                    if key not in held and await self._load(session, endpoint, name, key, w):
                        held[key] = _Held(w.served_name, w.path, rfc3339_now())
                        changed = True
        return changed

    async def _load(self, session: aiohttp.ClientSession, endpoint: str, pod: str, key: str, w: Wanted) -> bool:
        started = time.perf_counter()
        status, text = await _post(session, endpoint, "/v1/load_lora_adapter",
                                   {"lora_name": w.served_name, "lora_path": w.path})
        if status == 200 or "already been loaded" in text:
            self.failures.pop(key, None)
            log.info("loaded LoRAAdapter %s into pod %s in %.3f s", key, pod, time.perf_counter() - started)
            return True
        why = f"pod {pod}: HTTP {status}: {text[:200]}" if status else f"pod {pod}: {text[:200]}"
        if self.failures.get(key) != why:
            log.warning("LoRAAdapter %s: load refused, %s", key, why)
        self.failures[key] = why
        self.new_failures[key] = self.new_failures.get(key, 0) + 1
        return False

    async def _unload(self, session: aiohttp.ClientSession, endpoint: str, pod: str, served_name: str) -> None:
        status, text = await _post(session, endpoint, "/v1/unload_lora_adapter", {"lora_name": served_name})
        if status == 200:
            log.info("unloaded LoRA adapter %s from pod %s", served_name, pod)
        else:
            log.info("unloading LoRA adapter %s from pod %s: %s", served_name, pod, text[:200] or status)


def _http_port(pod: Mapping[str, Any]) -> int | None:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http":
                return int(port["containerPort"])
    return None


async def _post(session: aiohttp.ClientSession, endpoint: str, path: str, body: Mapping[str, Any]) -> tuple[int, str]:
    """(HTTP status, body text); status 0 with the error when the engine cannot be reached."""
    try:
        async with session.post(f"http://{endpoint}{path}", json=dict(body)) as resp:
            return resp.status, await resp.text()
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return 0, f"cannot reach the engine: {exc.__class__.__name__}: {exc}"
