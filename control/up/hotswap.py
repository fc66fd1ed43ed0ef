"""LoRA adapters swapped in and out of running replicas on demand, for one base model of `wakegate up`
whose engine loads adapters at run time (vLLM's `--enable-lora` API; the sim).

`up` is the one owner of every load and unload: the gateways (two extprocs) only hold requests
and report what they hold and what they send where (extproc/adapters.py, summed by the demand
book), so two gateways can never race into two evictions. Each :meth:`HotSwap.reconcile` (on
a demand report, a replica change, the end of a load, an idle deadline) decides, with `now`:

1. use: an adapter some gateway has in flight on an endpoint is pinned there (never unloaded);
   one whose routed count moved was used now (its place in the LRU order);
2. held requests: an adapter wanted on no ready replica is loaded on one, chosen by
   :func:`choose` (a free slot first, the least loaded; else the replica whose least recently
   used adapter no request uses is the oldest, which is evicted); random placement asks for one
   endpoint, and the adapter is loaded there (evicting that replica's LRU);
3. spill: when every holder of an adapter in use has `contract.QUEUE_LIMIT` or more requests
   waiting, a copy goes to another replica with a free slot (never by eviction: no thrashing);
4. idle: an adapter unused for the idle timeout is unloaded.

An unload is two-phase, so that no request is sent to an endpoint that lost its adapter: the
endpoint leaves the adapter's holders in the route (gateways stop choosing it for that adapter),
and after :data:`UNROUTE_SECONDS` (longer than the gateways' coalesced report interval) the
engine is told only if no gateway reported the adapter in flight or routed there meanwhile, no
request is held for it and the engine itself reports none running or waiting with it; otherwise
it is put back. A failed fetch or load is counted in the
route (the gateways fail the requests they hold for it with the reason) and not tried again for
:data:`FAILURE_COOLDOWN`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from wakegate import contract, promtext
from wakegate.control.backends import BACKENDS
from wakegate.control.delivery.errors import DeliveryError
from wakegate.control.demand.book import AdapterLoad
from wakegate.control.feeder.routed import RoutedAdapter
from wakegate.control.schema import LoRAAdapter, Model
from wakegate.control.up.adapters import LATENCIES_KEPT, AdapterError, AdapterLoader, AdapterSlots
from wakegate.control.up.weights import Delivery, Weights, WeightsWatch

log = logging.getLogger("wakegate.up.adapters")

#: Seconds between taking an endpoint out of an adapter's holders and unloading it there: the
#: gateways report a use within 0.25 s (extproc/demand.py, LAZY_INTERVAL).
UNROUTE_SECONDS = 0.3
#: Seconds after a failed fetch or load before the adapter is tried again.
FAILURE_COOLDOWN = 2.0


@dataclass
class AdapterRecord:
    """One LoRAAdapter of the base: its weights and what happened to it."""

    adapter: LoRAAdapter
    watch: WeightsWatch
    weights: Weights | None = None
    loads: int = 0
    unloads: int = 0
    failures: int = 0
    last_failure: str = ""
    #: When the last failure happened (monotonic), for the cooldown.
    failed_at: float | None = None
    #: When it was last loaded anywhere (wall clock), and how long that took.
    last_load: float | None = None
    last_load_seconds: float | None = None
    #: Endpoints a load of it is under way to.
    loading: set[str] = field(default_factory=set)


@dataclass
class AdapterEvents:
    """Hooks for metrics: a load (adapter, seconds), an unload (adapter, why: evicted or idle), a failure."""

    loaded: Callable[[str, float], None] = lambda adapter, seconds: None
    unloaded: Callable[[str, str], None] = lambda adapter, reason: None
    failed: Callable[[str], None] = lambda adapter: None


#: Endpoint -> (requests its engine holds, requests waiting there), of the ready replicas.
ReadyLoads = Mapping[str, tuple[int, int]]


def choose(
    ready: ReadyLoads,
    slots: Mapping[str, AdapterSlots],
    pending: Mapping[str, int],
    leaving: set[tuple[str, str]],
    cap: int,
) -> tuple[str, str | None] | None:
    """Where to load an adapter no ready replica holds: (endpoint, adapter to evict first or None),
    or None when every slot of every replica is in use (or on its way). Pure."""
    free = [ep for ep in ready if (len(slots[ep]) if ep in slots else 0) + pending.get(ep, 0) < cap]
    if free:
        return min(free, key=lambda ep: (ready[ep][0], ep)), None
    oldest: tuple[float, int, str, str] | None = None
    for ep in ready:
        found = victim_of(slots[ep], ep, leaving) if ep in slots and not pending.get(ep) else None
        if found is not None:
            name, used = found
            candidate = (used, ready[ep][0], ep, name)
            oldest = candidate if oldest is None or candidate < oldest else oldest
    return None if oldest is None else (oldest[2], oldest[3])


def victim_of(slots: AdapterSlots, endpoint: str, leaving: set[tuple[str, str]]) -> tuple[str, float] | None:
    """The least recently used adapter of a replica that no request uses and is not already leaving."""
    for name, used in slots.used_at.items():
        if not slots.pins.get(name) and (endpoint, name) not in leaving:
            return name, used
    return None


class HotSwap:
    """The on-demand adapters of one base model's replicas."""

    def __init__(
        self,
        model: Model,
        delivery: Delivery,
        *,
        base_dir: Path | None,
        demand: Callable[[], Mapping[str, AdapterLoad]],
        ready: Callable[[], ReadyLoads],
        publish: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = model
        self.cap = model.spec.adapters.maxAdapters
        self.idle_seconds = float(model.spec.adapters.idleTimeout or model.spec.scaling.idleTimeout)
        self.loader = AdapterLoader(self.cap, clock)
        self.records = {
            a.served_name: AdapterRecord(a, WeightsWatch(f"{model.key}/{a.name}", a.spec.source))
            for a in model.adapters
        }
        self.events = AdapterEvents()
        self.load_seconds: deque[float] = deque(maxlen=LATENCIES_KEPT)
        #: (endpoint, adapter) taken out of the route, about to be unloaded
        self.leaving: set[tuple[str, str]] = set()
        self._delivery = delivery
        self._base_dir = base_dir
        self._demand = demand
        self._ready = ready
        self._publish = publish
        self._clock = clock
        self._seen_routed: dict[tuple[str, str], int] = {}
        self._unloading: set[tuple[str, str]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._timer_at: float | None = None
        self._session: aiohttp.ClientSession | None = None

    # -- what the runtime asks ---------------------------------------------------------------------

    def poke(self) -> None:
        self._wake.set()

    def forget(self, endpoint: str) -> None:
        """A replica's process ended: its adapters went with it."""
        self.loader.forget(endpoint)
        self.leaving = {pair for pair in self.leaving if pair[0] != endpoint}
        self._seen_routed = {k: v for k, v in self._seen_routed.items() if k[1] != endpoint}
        self.poke()

    def holders(self, adapter: str, ready: ReadyLoads | None = None) -> list[str]:
        """Ready endpoints that hold `adapter` and are not about to lose it."""
        ready = self._ready() if ready is None else ready
        return sorted(
            ep for ep, slots in self.loader.replicas.items()
            if adapter in slots and ep in ready and (ep, adapter) not in self.leaving
        )

    def routed(self, base: tuple[RoutedAdapter, ...]) -> tuple[RoutedAdapter, ...]:
        """The route's adapters with their holders and failures."""
        ready = self._ready()
        out = []
        for adapter in base:
            record = self.records[adapter.served_name]
            out.append(replace(
                adapter,
                endpoints=tuple(self.holders(adapter.served_name, ready)),
                failed_loads=record.failures,
                last_failure=record.last_failure,
            ))
        return tuple(out)

    async def preload(self, session: aiohttp.ClientSession, endpoint: str) -> None:
        """Before a new replica is routed: the adapters requests are held for (so the requests that
        woke the base are released to a replica that has them), then, when all of the base's
        adapters fit in `maxAdapters`, the rest. A failure is the adapter's, never the replica's."""
        totals = self._demand()
        wanted = [name for name, load in sorted(totals.items(), key=lambda kv: -kv[1].held) if load.held]
        order = [name for name in wanted if name in self.records]
        if len(self.records) <= self.cap:
            order += [name for name in self.records if name not in order]
        now = self._clock()
        session = self._session or session  # the engine's probe session times out after 2 s
        for name in order[: self.cap]:
            record = self.records[name]
            if record.failed_at is not None and now - record.failed_at < FAILURE_COOLDOWN:
                continue
            async with self.loader.turn(endpoint):
                await self._load(session, record, endpoint)

    def status(self, replica_names: Mapping[str, str]) -> dict[str, dict[str, Any]]:
        """Per LoRAAdapter (metadata name): who holds it, its loads and unloads, its last failure."""
        ready = self._ready()
        out: dict[str, dict[str, Any]] = {}
        for record in self.records.values():
            held = self.holders(record.adapter.served_name, ready)
            holders = [replica_names[ep] for ep in held if ep in replica_names]
            weights = record.watch.status()
            failure = weights["error"] or (
                {"reason": "load_failed", "message": record.last_failure} if record.last_failure else None
            )
            out[record.adapter.name] = {
                "base": self.model.name,
                "served_name": record.adapter.served_name,
                "source": record.adapter.spec.source,
                "replicas": holders,
                "loaded_replicas": len(holders),
                "last_load": None if record.last_load is None else time.strftime(
                    "%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.last_load)),
                "last_load_seconds": record.last_load_seconds,
                "loads": record.loads,
                "unloads": record.unloads,
                "failures": record.failures,
                "failure": failure,
                "weights": weights,
            }
        return out

    def load_summary(self) -> dict[str, Any]:
        """Loads so far and their latency (p50, p95, max over the last LATENCIES_KEPT), for /status."""
        seconds = sorted(self.load_seconds)
        if not seconds:
            return {"loads": 0, "p50_seconds": None, "p95_seconds": None, "max_seconds": None}

        def at(share: float) -> float:
            return round(seconds[min(len(seconds) - 1, int(len(seconds) * share))], 4)

        return {
            "loads": sum(r.loads for r in self.records.values()),
            "p50_seconds": at(0.5),
            "p95_seconds": at(0.95),
            "max_seconds": round(seconds[-1], 4),
        }

    # -- the loop -----------------------------------------------------------------------------------

    async def run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            self._session = session
            try:
                while True:
                    timeout = None if self._timer_at is None else max(0.0, self._timer_at - self._clock())
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), timeout)
                    self._wake.clear()
                    self.reconcile()
            finally:
                for task in list(self._tasks):
                    task.cancel()
                for task in list(self._tasks):
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                self._session = None

    def close(self) -> None:
        """Let go of every adapter's weights (the runtime stopped)."""
        for record in self.records.values():
            if record.weights is not None:
                record.weights.release()
                record.weights = None

    def reconcile(self) -> None:
        """Decide what to load and unload now (see the module docstring); engine calls run as tasks."""
        now = self._clock()
        totals = self._demand()
        ready = self._ready()
        self._note_use(totals, now)
        pending: dict[str, int] = {}
        for busy in self.records.values():
            for ep in busy.loading:
                pending[ep] = pending.get(ep, 0) + 1
        next_at: float | None = None
        for name, load in sorted(totals.items(), key=lambda kv: -kv[1].held):
            record = self.records.get(name)
            if record is None or not load.held:
                continue
            if record.failed_at is not None and now - record.failed_at < FAILURE_COOLDOWN:
                next_at = _sooner(next_at, record.failed_at + FAILURE_COOLDOWN)
                continue
            for ep in load.wanted:
                if ep not in ready or ep in record.loading:
                    continue
                slots = self.loader.slots(ep)
                if name in slots:
                    continue
                if len(slots) + pending.get(ep, 0) < self.cap or victim_of(slots, ep, self.leaving) is not None:
                    self._spawn(self._load_on(record, ep, None), record, ep, pending)
            if load.queued and not record.loading and not self.holders(name, ready):
                choice = choose(ready, self.loader.replicas, pending, self.leaving, self.cap)
                if choice is not None:
                    self._spawn(self._load_on(record, *choice), record, choice[0], pending)
        self._spill(totals, ready, pending)
        for ep, slots in list(self.loader.replicas.items()):
            for name in slots.idle(now, self.idle_seconds):
                if (ep, name) not in self._unloading and (ep, name) not in self.leaving:
                    self._unloading.add((ep, name))
                    self._track(self._unload_idle(ep, name))
            for name, used in slots.used_at.items():
                if not slots.pins.get(name):
                    next_at = _sooner(next_at, used + self.idle_seconds)
        self._timer_at = next_at

    def _note_use(self, totals: Mapping[str, AdapterLoad], now: float) -> None:
        for ep, slots in self.loader.replicas.items():
            for name in slots.used_at:  # in LRU order: uses seen at once keep their order
                load = totals.get(name)
                flight = load.in_flight.get(ep, 0) if load is not None else 0
                routed = load.routed.get(ep, 0) if load is not None else 0
                if flight:
                    slots.pins[name] = flight
                else:
                    slots.pins.pop(name, None)
                if flight or self._seen_routed.get((name, ep), 0) != routed:
                    slots.touch(name, now)
                self._seen_routed[(name, ep)] = routed

    def _spill(self, totals: Mapping[str, AdapterLoad], ready: ReadyLoads, pending: dict[str, int]) -> None:
        """Every holder of an adapter in use is saturated: a copy into a free slot elsewhere."""
        for name, load in totals.items():
            spilled = self.records.get(name)
            if spilled is None or spilled.loading or not any(load.in_flight.values()):
                continue
            holders = self.holders(name, ready)
            if not holders or any(ready[ep][1] < contract.QUEUE_LIMIT for ep in holders):
                continue
            free = [
                ep for ep in ready
                if ep not in holders and len(self.loader.slots(ep)) + pending.get(ep, 0) < self.cap
            ]
            if free:
                target = min(free, key=lambda ep: (ready[ep][0], ep))
                log.info("adapter spill model=%s adapter=%s to=%s: every holder is saturated",
                         self.model.key, name, target)
                self._spawn(self._load_on(spilled, target, None), spilled, target, pending)

    def _spawn(
        self, job: Coroutine[Any, Any, None], record: AdapterRecord, endpoint: str, pending: dict[str, int]
    ) -> None:
        record.loading.add(endpoint)
        pending[endpoint] = pending.get(endpoint, 0) + 1
        self._track(job)

    def _track(self, job: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(job)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- engine calls ---------------------------------------------------------------------------------

    async def _load_on(self, record: AdapterRecord, endpoint: str, victim: str | None) -> None:
        name = record.adapter.served_name
        try:
            async with self.loader.turn(endpoint):
                session = self._session
                if session is None or endpoint not in self._ready():
                    return
                slots = self.loader.slots(endpoint)
                if name in slots:
                    return
                if len(slots) >= self.cap:
                    found = victim if victim in slots.names else None
                    if found is None:
                        picked = victim_of(slots, endpoint, self.leaving)
                        found = picked[0] if picked is not None else None
                    if found is None or not await self._evict(session, endpoint, found, "evicted"):
                        return  # every adapter there is in use: the next reconcile decides again
                await self._load(session, record, endpoint)
        finally:
            record.loading.discard(endpoint)
            self._publish()
            self.poke()

    async def _load(self, session: aiohttp.ClientSession, record: AdapterRecord, endpoint: str) -> None:
        """Fetch (once) and load one adapter into `endpoint`, which has room; a failure is recorded."""
        name = record.adapter.served_name
        try:
            if record.weights is None:
                record.weights = await self._delivery.acquire_adapter(
                    record.adapter, record.watch, base_dir=self._base_dir
                )
            # The adapter's folder (PEFT's config beside its weights) is what the engine loads.
            seconds = await self.loader.load(session, endpoint, name, str(record.weights.folder))
        except DeliveryError as exc:
            self._failed(record, f"weights unavailable: {exc}")
            return
        except AdapterError as exc:
            self._failed(record, f"the engine refused the load: {exc}")
            return
        record.loads += 1
        record.last_load = time.time()
        record.last_load_seconds = round(seconds, 4)
        record.failed_at = None
        record.last_failure = ""
        self.load_seconds.append(seconds)
        self.events.loaded(name, seconds)
        log.info("adapter loaded model=%s adapter=%s endpoint=%s seconds=%.3f", self.model.key, name, endpoint,
                 seconds)

    def _failed(self, record: AdapterRecord, reason: str) -> None:
        record.failures += 1
        record.last_failure = reason
        record.failed_at = self._clock()
        self.events.failed(record.adapter.served_name)
        log.warning("adapter load failed model=%s adapter=%s failures=%d: %s", self.model.key,
                    record.adapter.served_name, record.failures, reason)

    async def _unload_idle(self, endpoint: str, name: str) -> None:
        try:
            async with self.loader.turn(endpoint):
                session = self._session
                slots = self.loader.replicas.get(endpoint)
                if session is None or slots is None or name not in slots.idle(self._clock(), self.idle_seconds):
                    return
                await self._evict(session, endpoint, name, "idle")
        finally:
            self._unloading.discard((endpoint, name))
            self.poke()

    async def _evict(self, session: aiohttp.ClientSession, endpoint: str, name: str, reason: str) -> bool:
        """Take `name` off `endpoint` the two-phase way; False (and put back) when a gateway used it meanwhile."""
        self.leaving.add((endpoint, name))
        self._publish()
        before = self._routed_at(name, endpoint)
        try:
            await asyncio.sleep(UNROUTE_SECONDS)
            load = self._demand().get(name)
            slots = self.loader.slots(endpoint)
            in_flight = load.in_flight.get(endpoint, 0) if load is not None else 0
            used = in_flight > 0 or self._routed_at(name, endpoint) != before
            wanted = load is not None and load.held > 0  # a request waits for it: keep it here
            if not (used or wanted) and await self._engine_runs(session, endpoint, name):
                used = True  # a request whose use no gateway has reported yet
            if used or wanted or slots.pins.get(name):
                slots.touch(name, self._clock())
                log.info("adapter kept model=%s adapter=%s endpoint=%s: in use", self.model.key, name, endpoint)
                return False
            await self.loader.unload(session, endpoint, name)
        finally:
            self.leaving.discard((endpoint, name))
            self._publish()
        record = self.records.get(name)
        if record is not None:
            record.unloads += 1
        self.events.unloaded(name, reason)
        log.info("adapter unloaded model=%s adapter=%s endpoint=%s reason=%s", self.model.key, name, endpoint, reason)
        return True

    async def _engine_runs(self, session: aiohttp.ClientSession, endpoint: str, name: str) -> bool:
        """Whether the engine itself reports `name` running or waiting (`vllm:lora_requests_info`);
        an engine that does not answer in time says no."""
        try:
            url = f"http://{endpoint}{BACKENDS[self.model.spec.backend].metrics_path}"
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as resp:
                text = await resp.text() if resp.status == 200 else ""
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False
        current = contract.current_lora_info(promtext.samples(text, (contract.VLLM_LORA_INFO,)))
        return current is not None and name in current[0]

    def _routed_at(self, name: str, endpoint: str) -> int:
        load = self._demand().get(name)
        return load.routed.get(endpoint, 0) if load is not None else 0


def _sooner(current: float | None, candidate: float) -> float:
    return candidate if current is None else min(current, candidate)
