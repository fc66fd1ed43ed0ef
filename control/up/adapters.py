"""LoRA adapters held by running replicas of engines that load them at run time (vLLM's
`--enable-lora` API): at most `maxAdapters` per replica, the least recently used unloaded to make
room, adapters in use never.

    loader = AdapterLoader(cap=4)
    loaded_now = await loader.ensure(session, "127.0.0.1:8001", "sql", "/cache/…/sql")  # pinned
    ...                                                                               # the request
    loader.release("127.0.0.1:8001", "sql")

`AdapterSlots` is the bookkeeping of one replica (no I/O); `AdapterLoader` does the engine calls
(`POST /v1/load_lora_adapter` {lora_name, lora_path}, `POST /v1/unload_lora_adapter` {lora_name}),
one at a time per replica (`turn`), and keeps the numbers: loads, unloads, failures with their
reason, each load's latency. `ensure` pins per request (the benchmark's direct mode);
`wakegate up` decides loads and unloads from the gateways' demand in control/up/hotswap.py and
uses `load`, `unload` and `turn`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

log = logging.getLogger("wakegate.up.adapters")

#: Load latencies kept for the percentiles /status and the benchmark report.
LATENCIES_KEPT = 4096


class AdapterError(Exception):
    """The engine refused or failed a load; the message is its answer (safe to show)."""


class AdapterSlots:
    """The adapters one replica holds, least recently used first, at most `cap`."""

    def __init__(self, cap: int) -> None:
        if cap < 1:
            raise ValueError("a replica holds at least one adapter")
        self.cap = cap
        self._used: OrderedDict[str, float] = OrderedDict()
        #: adapter -> requests using it now; an adapter in use is never unloaded
        self.pins: dict[str, int] = {}

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._used)

    def __contains__(self, name: object) -> bool:
        return name in self._used

    def __len__(self) -> int:
        return len(self._used)

    def touch(self, name: str, now: float) -> None:
        self._used[name] = now
        self._used.move_to_end(name)

    @property
    def full(self) -> bool:
        return len(self._used) >= self.cap

    def victim(self) -> str | None:
        """The adapter to unload before another can be loaded, when full: the least recently used
        of those no request uses now (None: there is room, or every one is in use)."""
        if not self.full:
            return None
        return next((name for name in self._used if not self.pins.get(name)), None)

    def pin(self, name: str) -> None:
        self.pins[name] = self.pins.get(name, 0) + 1

    def unpin(self, name: str) -> None:
        left = self.pins.get(name, 0) - 1
        if left > 0:
            self.pins[name] = left
        else:
            self.pins.pop(name, None)

    def remove(self, name: str) -> None:
        self._used.pop(name, None)

    @property
    def used_at(self) -> dict[str, float]:
        """Adapter -> when it was last used, least recently used first (read only)."""
        return dict(self._used)

    def idle(self, now: float, seconds: float) -> list[str]:
        """Adapters unused for `seconds` or longer and not in use, oldest first."""
        return [name for name, used in self._used.items() if now - used >= seconds and not self.pins.get(name)]


@dataclass
class AdapterStats:
    loads: int = 0
    unloads: int = 0
    failures: int = 0
    last_failure: str = ""
    #: Seconds each load took, as the engine answered it (the last LATENCIES_KEPT).
    load_seconds: list[float] = field(default_factory=list)
    #: When each adapter was last loaded anywhere (wall clock).
    last_load: dict[str, float] = field(default_factory=dict)


class AdapterLoader:
    """Loads adapters into replicas (endpoint "host:port") on demand, evicting by LRU."""

    def __init__(self, cap: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.cap = cap
        self._clock = clock
        self.replicas: dict[str, AdapterSlots] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.stats = AdapterStats()

    def slots(self, endpoint: str) -> AdapterSlots:
        found = self.replicas.get(endpoint)
        if found is None:
            found = self.replicas[endpoint] = AdapterSlots(self.cap)
        return found

    def forget(self, endpoint: str) -> None:
        """A replica went away, and its adapters with it."""
        self.replicas.pop(endpoint, None)
        self._locks.pop(endpoint, None)

    def turn(self, endpoint: str) -> asyncio.Lock:
        """The lock that keeps engine calls on `endpoint` one at a time."""
        return self._locks.setdefault(endpoint, asyncio.Lock())

    def holders(self, name: str) -> list[str]:
        return sorted(ep for ep, slots in self.replicas.items() if name in slots)

    async def ensure(self, session: aiohttp.ClientSession, endpoint: str, name: str, path: str) -> bool:
        """Make `endpoint` hold adapter `name` (from `path`) and pin it there for one request
        (:meth:`release` after it); True when it had to be loaded now. When every held adapter
        is in use, the load waits for one to be released."""
        slots = self.slots(endpoint)
        if name in slots:
            slots.touch(name, self._clock())
            slots.pin(name)
            return False
        async with self.turn(endpoint):
            if name in slots:  # loaded by a request that waited on the same lock
                slots.touch(name, self._clock())
                slots.pin(name)
                return False
            while slots.full:
                victim = slots.victim()
                if victim is None:
                    await asyncio.sleep(0.005)  # every adapter is in use: wait for a request to end
                    continue
                await self.unload(session, endpoint, victim)
            await self.load(session, endpoint, name, path)
            slots.pin(name)
            return True

    async def load(self, session: aiohttp.ClientSession, endpoint: str, name: str, path: str) -> float:
        """One engine call that loads `name` into `endpoint`, which has room (the caller made it);
        returns the seconds it took. Raises AdapterError with the engine's answer."""
        started = time.perf_counter()
        body = {"lora_name": name, "lora_path": path}
        status, text = await _post(session, endpoint, "/v1/load_lora_adapter", body)
        if status != 200 and "already been loaded" not in text:
            self.stats.failures += 1
            self.stats.last_failure = f"{name} on {endpoint}: HTTP {status}: {text[:200]}"
            log.warning("adapter load failed adapter=%s endpoint=%s status=%d", name, endpoint, status)
            raise AdapterError(self.stats.last_failure)
        seconds = time.perf_counter() - started
        self.stats.load_seconds.append(seconds)
        del self.stats.load_seconds[:-LATENCIES_KEPT]
        self.stats.loads += 1
        self.stats.last_load[name] = time.time()
        self.slots(endpoint).touch(name, self._clock())
        return seconds

    def release(self, endpoint: str, name: str) -> None:
        """One request of adapter `name` on `endpoint` ended."""
        slots = self.replicas.get(endpoint)
        if slots is not None:
            slots.unpin(name)

    async def unload(self, session: aiohttp.ClientSession, endpoint: str, name: str) -> None:
        """One engine call that unloads `name` from `endpoint` (the caller holds its turn there)."""
        self.slots(endpoint).remove(name)  # first: no request may pick it while it goes
        status, _ = await _post(session, endpoint, "/v1/unload_lora_adapter", {"lora_name": name})
        if status not in (200, 404):  # 404: the engine had lost it already
            log.warning("adapter unload failed adapter=%s endpoint=%s status=%d", name, endpoint, status)
        self.stats.unloads += 1


async def _post(session: aiohttp.ClientSession, endpoint: str, path: str, body: dict[str, str]) -> tuple[int, str]:
    try:
        async with session.post(f"http://{endpoint}{path}", json=body) as resp:
            return resp.status, await resp.text()
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return 0, type(exc).__name__
