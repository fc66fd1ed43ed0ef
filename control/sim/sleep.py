"""The simulator's sleep mode: vLLM's documented HTTP API, with configurable timings and memory.

vLLM (`--enable-sleep-mode`, endpoints only with `VLLM_SERVER_DEV_MODE=1`; docs.vllm.ai, "Sleep
Mode") answers:

* ``POST /sleep?level=1`` offloads the weights to host memory and discards the KV cache;
  ``level=2`` discards both. 200 once done.
* ``POST /wake_up`` (optionally ``?tags=weights`` or ``?tags=kv_cache``, repeatable) brings the
  named memory back to the accelerator. After level 2 the weights' memory comes back empty: a
  server reloads them with ``POST /collective_rpc {"method": "reload_weights"}`` between waking the
  weights and the KV cache.
* ``GET /is_sleeping`` -> ``{"is_sleeping": true|false}``: true while any of it sleeps.

What the sim adds, so that tests and benchmarks can see the tiers: each step takes a
configurable time (``--sleep-seconds``, ``--wake-seconds``, ``--reload-weights-seconds``), and its
simulated memory (``--weights-mb``, ``--kv-cache-mb``, ``--context-mb``: what a sleeping engine
keeps on the accelerator) is reported as ``wakegate_sim_accelerator_memory_bytes`` and
``wakegate_sim_host_memory_bytes``. A generation asked of a sleeping engine is refused (503), and
one asked after a level-2 wake without reloaded weights is an error (500), as its answers would be
garbage on a real engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

from aiohttp import web
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("wakegate.sim")

MB = 1024 * 1024
TAGS = ("weights", "kv_cache")


@dataclass(frozen=True)
class SleepConfig:
    """`--enable-sleep-mode` and what sleeping costs; `dev_mode` is `VLLM_SERVER_DEV_MODE=1`."""

    enabled: bool = False
    dev_mode: bool = False
    #: what POST /sleep takes
    sleep_seconds: float = 0.05
    #: what moving the weights back from host memory takes (a level-1 wake)
    wake_seconds: float = 0.2
    #: what `reload_weights` takes after a level-2 sleep (a read from disk)
    reload_weights_seconds: float = 1.0
    #: simulated memory, MiB: weights, KV cache, and what a sleeping engine keeps on the accelerator
    weights_mb: int = 1024
    kv_cache_mb: int = 1024
    context_mb: int = 256


class SleepMode(Collector):
    """The sleep state of one simulated engine and its HTTP handlers."""

    def __init__(self, cfg: SleepConfig, on_sleep: Callable[[], None]) -> None:
        self.cfg = cfg
        #: tag -> asleep
        self.asleep = dict.fromkeys(TAGS, False)
        #: False after a level-2 sleep until the weights are reloaded
        self.weights_valid = True
        #: where the weights are: "accelerator", "host" (level 1) or "nowhere" (level 2)
        self.weights_at = "accelerator"
        self.level = 0
        self.sleeps = 0
        self.wakes = 0
        self._on_sleep = on_sleep
        self._lock = asyncio.Lock()

    @property
    def sleeping(self) -> bool:
        return any(self.asleep.values())

    def refusal(self) -> tuple[int, str] | None:
        """Why a generation cannot run now (status, message), or None."""
        if self.sleeping:
            return 503, "The engine is sleeping; wake it with POST /wake_up"
        if not self.weights_valid:
            return 500, "The weights were discarded by sleep level 2 and not reloaded (POST /collective_rpc)"
        return None

    def routes(self) -> dict[str, tuple[frozenset[str], Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]]]:
        return {
            "/sleep": (frozenset({"POST"}), self.sleep),
            "/wake_up": (frozenset({"POST"}), self.wake_up),
            "/is_sleeping": (frozenset({"GET"}), self.is_sleeping),
            "/collective_rpc": (frozenset({"POST"}), self.collective_rpc),
        }

    async def sleep(self, request: web.BaseRequest) -> web.StreamResponse:
        level_text = request.query.get("level", "1")
        if level_text not in ("1", "2"):
            return _error(400, f"level must be 1 or 2, got {level_text!r}")
        level = int(level_text)
        async with self._lock:
            if self.sleeping:
                return web.Response(status=200)
            await asyncio.sleep(self.cfg.sleep_seconds)
            self._on_sleep()
            self.asleep = dict.fromkeys(TAGS, True)
            self.level = level
            self.weights_at = "host" if level == 1 else "nowhere"
            self.weights_valid = level == 1
            self.sleeps += 1
        log.info("sim asleep level=%d", level)
        return web.Response(status=200)

    async def wake_up(self, request: web.BaseRequest) -> web.StreamResponse:
        tags = request.query.getall("tags", []) or list(TAGS)
        unknown = [t for t in tags if t not in TAGS]
        if unknown:
            return _error(400, f"unknown tags {unknown}; known: {list(TAGS)}")
        async with self._lock:
            waking = [t for t in tags if self.asleep[t]]
            if waking:
                # Moving the weights back from host memory is the cost of a wake; the KV cache is
                # only reallocated.
                if "weights" in waking and self.weights_at == "host":
                    await asyncio.sleep(self.cfg.wake_seconds)
                    self.weights_at = "accelerator"
                elif "weights" in waking:
                    self.weights_at = "accelerator"  # allocated, empty until reloaded
                for tag in waking:
                    self.asleep[tag] = False
                if not self.sleeping:
                    self.wakes += 1
                    log.info("sim awake from level=%d weights_valid=%s", self.level, self.weights_valid)
        return web.Response(status=200)

    async def is_sleeping(self, request: web.BaseRequest) -> web.StreamResponse:
        return web.Response(body=json.dumps({"is_sleeping": self.sleeping}, separators=(",", ":")).encode(),
                            content_type="application/json")

    async def collective_rpc(self, request: web.BaseRequest) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except ValueError:
            return _error(400, "Malformed JSON body")
        method = body.get("method") if isinstance(body, dict) else None
        if method != "reload_weights":
            return _error(400, f"the sim's collective_rpc knows only reload_weights, got {method!r}")
        async with self._lock:
            if self.asleep["weights"]:
                return _error(400, "wake the weights first (POST /wake_up?tags=weights)")
            await asyncio.sleep(self.cfg.reload_weights_seconds)
            self.weights_valid = True
        log.info("sim weights reloaded")
        return web.Response(body=b'{"results":[null]}', content_type="application/json")

    # -- memory ---------------------------------------------------------------------------------

    def memory(self) -> tuple[int, int]:
        """(accelerator, host) bytes the simulated engine holds now."""
        cfg = self.cfg
        accelerator = cfg.context_mb
        host = 0
        if self.weights_at == "accelerator":
            accelerator += cfg.weights_mb
        elif self.weights_at == "host":
            host += cfg.weights_mb
        if not self.asleep["kv_cache"]:
            accelerator += cfg.kv_cache_mb
        return accelerator * MB, host * MB

    def collect(self) -> Iterator[Metric]:
        accelerator, host = self.memory()
        yield GaugeMetricFamily(
            "wakegate_sim_accelerator_memory_bytes",
            "Simulated accelerator memory the engine holds (weights, KV cache, context).",
            value=accelerator,
        )
        yield GaugeMetricFamily(
            "wakegate_sim_host_memory_bytes", "Simulated host memory holding offloaded weights.", value=host
        )
        yield GaugeMetricFamily("wakegate_sim_sleeping", "1 while the engine sleeps.", value=int(self.sleeping))

    def describe(self) -> Iterator[Metric]:
        return iter(())


class SleepRefused(Exception):
    """A sleep-mode call the engine refuses; the simulator answers it as vLLM answers errors."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _error(status: int, message: str) -> web.Response:
    raise SleepRefused(status, message)
