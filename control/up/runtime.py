"""Local runtime for `wakegate up`: backend processes per model, their health, and what is routable.

Each model runs `replicas` backend processes on loopback ports. A replica is
routable once its health path answers 200; a replica whose process exits is
taken out of the routes at once and restarted with capped backoff. Every change
of routable endpoints is pushed to `on_change` (the xDS feeder), never polled
by the gateway.

A replica that fails to start (its weights cannot be had, the engine exits or never
loads) is tried again with exponential backoff within its activation's time
(`activationTimeout` from its first attempt, less `activation_margin`). Only when that
time is up does the activation fail: `failed_activations` grows, and the gateways answer
the requests they held with the last attempt's reason. Until then they keep holding them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import aiohttp

from wakegate import contract
from wakegate.control.admin import free_port
from wakegate.control.backends import BACKENDS, LoadSignals
from wakegate.control.backends.base import fill, kv_events_argv
from wakegate.control.delivery.cache import default_cache_dir
from wakegate.control.delivery.errors import DeliveryError
from wakegate.control.delivery.resolver import Access
from wakegate.control.demand.book import AdapterLoad
from wakegate.control.feeder.routed import RoutedModel, routed_adapters, routed_model
from wakegate.control.schema import Model
from wakegate.control.up.children import Child
from wakegate.control.up.engine import Engine, EngineError
from wakegate.control.up.gpus import GpuPool, Slot, visible_devices_env
from wakegate.control.up.hotswap import HotSwap
from wakegate.control.up.weights import Delivery, DeliveryConfig, Weights, WeightsWatch

log = logging.getLogger("wakegate.up")

#: After routing a new replica, how long its first answer check waits before looking at the
#: engine's load (held requests arrive within ~40 ms, docs/performance.md "Cold starts").
ANSWER_AFTER = 0.1


def activation_margin(timeout: float) -> float:
    """How long before `activationTimeout` runs out an activation whose attempts all failed is
    given up: a held request's own timeout runs from its arrival, a moment before the start
    attempts began, and it should hear the last attempt's reason rather than a bare timeout."""
    return min(1.0, timeout / 10)


@dataclass
class Activation:
    """One replica's start attempts since it last began from nothing (or was last given up on)."""

    began: float
    deadline: float
    #: Attempts that failed so far, and why the last one did.
    failed: int = 0
    last_failure: str = ""


class ReplicaState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    STOPPED = "stopped"
    #: The asleep tier: the process lives, the engine has let go of the model (unrouted).
    SLEEPING = "sleeping"
    ASLEEP = "asleep"
    WAKING = "waking"


#: States of a replica whose process lives but whose model is not on the accelerator (or is
#: getting there): the tier's task drives them; the watch loop only notices the process exit.
DORMANT = frozenset({ReplicaState.SLEEPING, ReplicaState.ASLEEP, ReplicaState.WAKING})


class Tier(StrEnum):
    """How far a model has idled: warm (serving), asleep (process alive, accelerator freed), zero."""

    WARM = "warm"
    ASLEEP = "asleep"
    ZERO = "zero"


@dataclass
class RuntimeSettings:
    """Knobs of the local runtime; one object per `up` process."""

    #: Where backend logs go: one file per replica.
    log_dir: Path = Path(".wakegate/logs")
    host: str = "127.0.0.1"
    #: Health probe period while a replica loads (short: readiness is noticed within this
    #: long, and held requests wait for it), and once it is ready.
    probe_interval_loading: float = 0.02
    probe_interval_ready: float = 2.0
    #: Restart backoff bounds after a crash.
    restart_backoff_min: float = 1.0
    restart_backoff_max: float = 30.0
    #: Grace given to a backend on stop before SIGKILL; in-flight streams finish within it.
    stop_grace: float = 30.0
    #: Pause between taking a replica out of the routes and signalling it, so that no
    #: request is sent to a backend that stopped listening (Envoy applies the push in ms).
    unroute_delay: float = 0.5
    #: Folder of engines' private state: one per model and replica slot (Ollama's model store).
    engines_dir: Path = Path(".wakegate/engines")
    #: Relative `file://` sources are found from here: the manifest's folder.
    base_dir: Path | None = None
    #: How often a ready replica's own load signals are read (for picking and draining).
    load_interval: float = 0.5


@dataclass
class Replica:
    index: int
    port: int
    child: Child
    state: ReplicaState = ReplicaState.STARTING
    started_at: float = field(default_factory=time.monotonic)
    ready_at: float | None = None
    restarts: int = 0
    task: asyncio.Task[None] | None = None
    gpu_owner: str = ""
    #: Lowest number free among the model's replicas: names the engine's private folder, which
    #: outlives the process (Ollama's store is reused on the next wake).
    slot: int = 0
    #: Cold-start timeline of the current process (monotonic seconds).
    #: The weights were on disk (pulled, checked, staged) and the process about to start.
    weights_at: float | None = None
    healthy_at: float | None = None
    #: The plugin's load steps done (Ollama: the model created in its store).
    prepared_at: float | None = None
    loaded_at: float | None = None
    first_byte: float | None = None
    #: When that first byte came (monotonic), for the timeline.
    first_byte_at: float | None = None
    #: The engine's own load signals, last read.
    load: LoadSignals | None = None
    #: The first answer asked of a new process (runs beside the first requests).
    probe: asyncio.Task[None] | None = None
    #: The weights the current process loads, leased until it exits.
    weights: Weights | None = None
    #: Its LoRAAdapters' weights (llama.cpp: all of the base's, given at start), leased likewise.
    #: Engines that load adapters at run time get them from the model's HotSwap instead.
    adapter_weights: list[Weights] = field(default_factory=list)
    #: The start attempts of its current activation (None once it is ready).
    activation: Activation | None = None
    #: When it last went to sleep (monotonic), while it sleeps.
    asleep_since: float | None = None


class ModelRuntime:
    """The replicas of one model."""

    def __init__(
        self,
        model: Model,
        settings: RuntimeSettings,
        on_change: Callable[[], None],
        gpus: GpuPool | None = None,
        delivery: Delivery | None = None,
    ) -> None:
        self.model = model
        self.gpus = gpus if gpus is not None else GpuPool()
        self.backend = BACKENDS[model.spec.backend]
        self.settings = settings
        self._on_change = on_change
        self.replicas: list[Replica] = []
        self.gpu_slots: dict[str, list[Slot]] = {}
        self._stopping = 0
        self._indexes = itertools.count()
        self.generation = 0
        self.failed_activations = 0
        self.last_failure = ""
        #: Start attempts that failed (each retried within its activation's time), and the last one's reason.
        self.failed_attempts = 0
        self.last_attempt_failure = ""
        #: What kind of failure the last one was (contract.WEIGHTS_UNAVAILABLE; empty: any other).
        self.last_failure_code = ""
        #: False while a GPU-group peer holds the accelerator.
        self.admitted = True
        #: The GPU-group peer this demanded model waits for (it holds the group, or is still stopping).
        self.waiting_for: str | None = None
        #: Seconds from the scale-from-zero decision to the first ready replica, last time.
        self.last_cold_start: float | None = None
        #: Hooks for the scaler and metrics: a replica spawned, became ready, or exited for good.
        self.on_spawned: Callable[[ModelRuntime, Replica], None] | None = None
        self.on_ready: Callable[[ModelRuntime, Replica], None] | None = None
        self.on_exit: Callable[[ModelRuntime], None] | None = None
        self.on_activation_failed: Callable[[ModelRuntime, str], None] | None = None
        self.on_attempt_failed: Callable[[ModelRuntime, str], None] | None = None
        #: A new process answered its first token (replica.first_byte is set).
        self.on_answered: Callable[[ModelRuntime, Replica], None] | None = None
        #: Requests in flight to this model over all gateways (drains engines without load signals).
        self.in_flight: Callable[[], int] = lambda: 0
        #: Where weights come from: one per `up` process, shared by every model (one cache).
        self.delivery = delivery or Delivery(DeliveryConfig(default_cache_dir()), Access())
        #: The weight file or folder the last engine start loads, resolved from `spec.source`.
        self.weights: Path | None = None
        #: The weights' progress, last result and failure, for the log and /status.
        self.weights_watch = WeightsWatch(model.key, model.spec.source or "")
        #: Each LoRAAdapter's weights (adapter name -> watch), and when a process last loaded it.
        self.adapter_watches = {
            a.name: WeightsWatch(f"{model.key}/{a.name}", a.spec.source) for a in model.adapters
        }
        self.adapter_loaded_at: dict[str, float] = {}
        #: The base's LoRAAdapters as the gateways hold for and use them (up's demand book).
        self.adapter_demand: Callable[[], Mapping[str, AdapterLoad]] = dict
        #: Engines that load adapters at run time: loads and unloads on demand (LRU, maxAdapters).
        self.hotswap: HotSwap | None = None
        if model.adapters and self.backend.lora_runtime_args and not self.backend.lora_arg:
            self.hotswap = HotSwap(
                model,
                self.delivery,
                base_dir=settings.base_dir,
                demand=lambda: self.adapter_demand(),
                ready=self._ready_loads,
                publish=self._on_change,
            )
        #: The last cold start's timeline: stage -> seconds since the activation signal.
        self.last_timeline: dict[str, float] = {}
        #: The asleep tier: the engine has one and the Model asks for it (scaling.sleepAfter).
        self.can_sleep = self.backend.can_sleep and model.spec.scaling.sleepAfter is not None
        #: What the tier's task drives the replicas to (True: asleep), and the task.
        self._asleep_wanted = False
        self._tier_task: asyncio.Task[None] | None = None
        #: A sleep the engine refused (or memory did not allow) is not tried again until the next demand.
        self.sleep_refused = ""
        #: When the wake in progress was asked for (the demand the scaler saw), for its duration.
        self._wake_asked: float | None = None
        #: Hooks: a replica woke from asleep (seconds since the wake was asked); the tier changed.
        self.on_woken: Callable[[ModelRuntime, float], None] | None = None
        self.on_tier: Callable[[ModelRuntime], None] | None = None
        #: The last wake from asleep: seconds from the demand to routed.
        self.last_wake_from_asleep: float | None = None
        self._last_tier: tuple[Tier, int] = (Tier.ZERO, 0)

    @property
    def ready_endpoints(self) -> tuple[tuple[str, int], ...]:
        return tuple((self.settings.host, r.port) for r in self.replicas if r.state is ReplicaState.READY)

    @property
    def endpoint_loads(self) -> tuple[tuple[str, int, int], ...]:
        """(host, port, requests the engine holds) of ready replicas whose engine reports load."""
        return tuple(
            (self.settings.host, r.port, r.load.queue)
            for r in self.replicas
            if r.state is ReplicaState.READY and r.load is not None
        )

    def _ready_loads(self) -> dict[str, tuple[int, int]]:
        """Ready replicas' endpoints -> (requests their engine holds, requests waiting), 0 when unknown."""
        return {
            f"{self.settings.host}:{r.port}": (r.load.queue, r.load.waiting) if r.load is not None else (0, 0)
            for r in self.replicas
            if r.state is ReplicaState.READY
        }

    def routed(self) -> RoutedModel:
        return routed_model(
            self.model,
            self.ready_endpoints,
            loads=self.endpoint_loads,
            generation=self.generation,
            failed_activations=self.failed_activations,
            last_failure=self.last_failure,
            failure_code=self.last_failure_code,
            admitted=self.admitted,
            adapters=None if self.hotswap is None else self.hotswap.routed(routed_adapters(self.model)),
            tokenizer=self._tokenizer(),
        )

    def _tokenizer(self) -> str:
        """The folder of the model's tokenizer, for the gateways' precise scoring, when its engine's
        KV events hash token ids: the weights folder a running replica loaded ("" otherwise)."""
        if not self.backend.kv_hashes_token_ids or self.model.spec.routing.kvEvents is None:
            return ""
        for replica in self.replicas:
            if replica.weights is not None and (replica.weights.folder / "tokenizer.json").exists():
                return str(replica.weights.folder)
        return ""

    @property
    def tier(self) -> Tier:
        """zero: no process; asleep: every process sleeps; else warm (going to sleep included)."""
        if not self.replicas:
            return Tier.ZERO
        if all(r.state is ReplicaState.ASLEEP for r in self.replicas):
            return Tier.ASLEEP
        return Tier.WARM

    @property
    def awake_count(self) -> int:
        """Processes that hold (or are about to hold) the accelerator: live ones less the sleeping."""
        return self.live_count - sum(1 for r in self.replicas if r.state is ReplicaState.ASLEEP)

    @property
    def asleep_count(self) -> int:
        return sum(1 for r in self.replicas if r.state in DORMANT)

    def want_asleep(self, asleep: bool, asked: float | None = None) -> None:
        """Drive every replica to sleep (True) or awake (False); `asked` is when the demand that
        wakes it was seen (the wake's duration counts from there)."""
        if not asleep:
            self.sleep_refused = ""
            if self._wake_asked is None and self.asleep_count:
                self._wake_asked = asked if asked is not None else time.monotonic()
        elif self.sleep_refused:
            return
        self._asleep_wanted = asleep
        idle = self._tier_task is None or self._tier_task.done()
        moving = ReplicaState.READY if asleep else ReplicaState.ASLEEP
        if idle and any(r.state is moving for r in self.replicas):
            # Only when a replica has somewhere to go: a model that is already there costs no task.
            self._tier_task = asyncio.create_task(self._drive_tier(), name=f"tier-{self.model.name}")

    async def _drive_tier(self) -> None:
        while True:
            if self._asleep_wanted:
                targets = [r for r in self.replicas if r.state is ReplicaState.READY]
                if not targets or self.sleep_refused:
                    return
                why = self._sleep_not_allowed()
                if why:
                    self.sleep_refused = why
                    log.info("sleep skipped model=%s: %s", self.model.key, why)
                    return
                await asyncio.gather(*(self._sleep_replica(r) for r in targets))
            else:
                targets = [r for r in self.replicas if r.state is ReplicaState.ASLEEP]
                if not targets:
                    self._wake_asked = None
                    return
                await asyncio.gather(*(self._wake_replica(r) for r in targets))

    @property
    def tier_units(self) -> int:
        """Accelerators the tier counts (one per replica without any): the awake replicas' while
        warm, the sleeping ones' while asleep, one replica's at zero."""
        per = max(1, self.gpus_per_replica)
        tier = self.tier
        if tier is Tier.ZERO:
            return per
        if tier is Tier.ASLEEP:
            return per * len(self.replicas)
        return per * sum(1 for r in self.replicas if r.state is not ReplicaState.ASLEEP)

    def _note_tier(self) -> None:
        """Tell `on_tier` when the model's tier (or the accelerators it counts) changed."""
        now = (self.tier, self.tier_units)
        if now != self._last_tier:
            self._last_tier = now
            if self.on_tier is not None:
                self.on_tier(self)

    def _sleep_not_allowed(self) -> str:
        """Why sleeping would not fit in memory now ("" when it does): level 1 keeps the weights in
        host memory (vLLM), so that much must be available."""
        level = self.model.spec.scaling.sleepLevel
        if not (self.backend.sleep_holds_weights and level == 1) or self.weights is None:
            return ""
        size = _size_of(self.weights)
        available = _host_memory_available()
        if available is not None and size * len(self.replicas) > available:
            return (f"level 1 keeps {size >> 20} MiB of weights per replica in host memory and "
                    f"{available >> 20} MiB are available")
        return ""

    def _engine(self, replica: Replica, session: aiohttp.ClientSession) -> Engine:
        return Engine(self.backend, session, self.settings.host, replica.port, self._values(replica), None)

    async def _sleep_replica(self, replica: Replica) -> None:
        """Unroute, drain, and ask the engine to sleep; a refusal keeps it warm (and is not retried
        until the next demand)."""
        replica.state = ReplicaState.SLEEPING
        self._changed()
        await asyncio.sleep(self.settings.unroute_delay)
        await self._drain(replica)
        level = self.model.spec.scaling.sleepLevel
        started = time.monotonic()
        async with aiohttp.ClientSession() as session:
            try:
                await self._engine(replica, session).sleep(level)
            except EngineError as exc:
                self.sleep_refused = str(exc)
                log.warning("sleep failed model=%s replica=%d: %s", self.model.key, replica.index, exc)
                if replica.state is ReplicaState.SLEEPING:
                    replica.state = ReplicaState.READY
                    self._changed()
                return
        if replica.state is not ReplicaState.SLEEPING:
            return  # stopped meanwhile
        replica.state = ReplicaState.ASLEEP
        replica.asleep_since = time.monotonic()
        replica.load = None
        self.gpus.doze(replica.gpu_owner, self.backend.asleep_vram_mb)
        log.info("replica asleep model=%s replica=%d level=%d seconds=%.3f", self.model.key, replica.index,
                 level, replica.asleep_since - started)
        self._changed()

    async def _wake_replica(self, replica: Replica) -> None:
        """Wake the engine and route it once it says the model is loaded; an engine that does not
        wake is stopped (the scaler starts a new one from zero)."""
        if not self.gpus.rouse(replica.gpu_owner):
            log.warning("wake model=%s replica=%d: its accelerator is taken; starting it anew",
                        self.model.key, replica.index)
            await replica.child.stop(self.backend.term_grace)
            return
        replica.state = ReplicaState.WAKING
        level = self.model.spec.scaling.sleepLevel
        async with aiohttp.ClientSession() as session:
            engine = self._engine(replica, session)
            try:
                await engine.wake(level)
                deadline = time.monotonic() + 30.0
                while not await engine.loaded():
                    if time.monotonic() > deadline:
                        raise EngineError("the model was not loaded 30s after the wake")
                    await asyncio.sleep(self.settings.probe_interval_loading)
            except EngineError as exc:
                log.warning("wake failed model=%s replica=%d: %s; stopping it", self.model.key, replica.index, exc)
                await replica.child.stop(self.backend.term_grace)
                return
        if replica.state is not ReplicaState.WAKING:
            return
        replica.state = ReplicaState.READY
        replica.ready_at = time.monotonic()
        replica.asleep_since = None
        asked = self._wake_asked if self._wake_asked is not None else replica.ready_at
        self.last_wake_from_asleep = replica.ready_at - asked
        log.info("replica awake model=%s replica=%d level=%d seconds=%.3f", self.model.key, replica.index,
                 level, self.last_wake_from_asleep)
        self._changed()
        if self.on_woken is not None:
            self.on_woken(self, self.last_wake_from_asleep)

    @property
    def replica_count(self) -> int:
        """Replicas the model is meant to have (starting, ready or restarting)."""
        return len(self.replicas)

    @property
    def live_count(self) -> int:
        """Processes of this model that exist, including replicas being stopped."""
        return len(self.replicas) + self._stopping

    async def scale_to(self, count: int) -> None:
        if count != len(self.replicas):
            log.info("scale model=%s from=%d to=%d", self.model.key, len(self.replicas), count)
        while len(self.replicas) < count:
            if self._start_replica() is None:
                log.warning(
                    "scale capped model=%s replicas=%d wanted=%d: not enough free GPUs",
                    self.model.key,
                    len(self.replicas),
                    count,
                )
                break
        self._note_tier()
        while len(self.replicas) > count:
            replica = self.replicas.pop()
            self._note_tier()
            await self._stop_replica(replica)

    async def stop(self) -> None:
        """Stop every replica; `up` calls this after Envoy and extproc are gone, so nothing is left
        in flight through the gateway and no drain is waited for."""
        if self._tier_task is not None:
            self._tier_task.cancel()
        await asyncio.gather(*(self._stop_replica(r, drain=False) for r in self.replicas))
        self.replicas.clear()
        if self.hotswap is not None:
            self.hotswap.close()

    # -- replicas ---------------------------------------------------------------------------------

    def _values(self, replica: Replica) -> dict[str, str]:
        """What the plugin's templates are filled with for one replica."""
        state = self.settings.engines_dir / self.model.name / str(replica.slot)
        weights = replica.weights.path if replica.weights is not None else self.weights
        return {
            "host": self.settings.host,
            "port": str(replica.port),
            # The engine gets the weights: the file (or folder) the source resolved to; without a
            # source, the served name (a hub id vLLM fetches itself).
            "model": str(weights) if weights is not None else self.model.served_name,
            "served_name": self.model.served_name,
            "state": str(state.resolve()),
            "max_adapters": str(self.model.spec.adapters.maxAdapters),
            "sleep_level": str(self.model.spec.scaling.sleepLevel),
        }

    def _argv(self, values: dict[str, str], adapters: Sequence[Weights] = ()) -> list[str]:
        argv = self.backend.command(values, tuple(self.model.spec.command)) + list(self.model.spec.args)
        if adapters and self.backend.lora_arg:
            argv += list(self.backend.lora_start_args)
            for weights in adapters:
                argv += [self.backend.lora_arg, str(weights.path)]
        elif self.model.adapters and self.backend.lora_runtime_args:
            argv += [fill(a, values) for a in self.backend.lora_runtime_args]
        if self.can_sleep:
            argv += [a for a in self.backend.sleep_args if a not in argv]
        kv = self.model.spec.routing.kvEvents
        if kv is not None:
            argv += kv_events_argv(self.backend, argv, int(values["port"]), kv.portOffset, kv.replayPortOffset)
        return argv

    def _env(self, values: dict[str, str], gpus: list[Slot]) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.backend.environment(values))
        env.update(visible_devices_env(gpus))
        if self.model.adapters:
            env.update(self.backend.lora_runtime_env)
        if self.can_sleep:
            env.update(self.backend.sleep_env)
        env.update(self.model.spec.env)
        return env

    async def _acquire_adapters(self, replica: Replica) -> None:
        """The base's LoRAAdapters, through the cache, for an engine that loads every one at start
        (llama.cpp), so that a first request for one never restarts the base. Engines that load
        them at run time get them from the HotSwap, on demand."""
        if not self.backend.lora_arg:
            return
        try:
            for adapter in self.model.adapters:
                watch = self.adapter_watches[adapter.name]
                weights = await self.delivery.acquire_adapter(adapter, watch, base_dir=self.settings.base_dir)
                replica.adapter_weights.append(weights)
        except DeliveryError as exc:
            self._release_weights(replica)
            raise DeliveryError(f"LoRAAdapter {adapter.name}: {exc}", exc.reason) from None

    def adapter_status(self) -> dict[str, dict[str, Any]]:
        """Per LoRAAdapter: the replicas that hold it, when it was last loaded, its weights' state."""
        ready = [r for r in self.replicas if r.state is ReplicaState.READY]
        if self.hotswap is not None:
            names = {f"{self.settings.host}:{r.port}": f"{self.model.name}-{r.index}" for r in ready}
            return self.hotswap.status(names)
        out: dict[str, dict[str, Any]] = {}
        for adapter in self.model.adapters:
            watch = self.adapter_watches[adapter.name]
            loaded_at = self.adapter_loaded_at.get(adapter.name)
            weights = watch.status()
            holders = [] if watch.error is not None else [f"{self.model.name}-{r.index}" for r in ready]
            out[adapter.name] = {
                "base": self.model.name,
                "served_name": adapter.served_name,
                "source": adapter.spec.source,
                "replicas": holders,
                "loaded_replicas": len(holders),
                "last_load": None if loaded_at is None else time.strftime(
                    "%Y-%m-%dT%H:%M:%SZ", time.gmtime(loaded_at)),
                "failure": weights["error"],
                "weights": weights,
            }
        return out

    async def _acquire_weights(self, replica: Replica, deadline: float) -> None:
        """`spec.source` to a local path for this start of the replica's engine, leased (relative
        file:// from the manifest's folder; oci:// and hf:// through the cache, checked). The
        weights must be there by the activation's `deadline` (its time less a margin), so that held
        requests learn why before their own timeout; a pull cut short keeps its bytes for the next try."""
        if self.model.spec.source is None:
            return
        timeout = float(self.model.spec.scaling.activationTimeout)
        budget = max(0.1, deadline - time.monotonic())
        acquire = self.delivery.acquire(
            self.model, self.weights_watch, base_dir=self.settings.base_dir, needs_file=self.backend.needs_file,
            folder=self.backend.loads_folder,
        )
        try:
            replica.weights = await asyncio.wait_for(acquire, budget)
        except TimeoutError:
            error = DeliveryError(
                f"{self.model.spec.source}: the weights were not ready within {budget:.0f}s of the "
                f"{timeout:.0f}s activationTimeout (bytes pulled so far are kept for the next activation)",
                "timeout",
            )
            self.weights_watch.failed(error)
            raise error from None
        self.weights = replica.weights.path

    def _release_weights(self, replica: Replica) -> None:
        if replica.weights is not None:
            replica.weights.release()
            replica.weights = None
        for weights in replica.adapter_weights:
            weights.release()
        replica.adapter_weights.clear()
        if self.hotswap is not None:
            self.hotswap.forget(f"{self.settings.host}:{replica.port}")

    @property
    def capacity(self) -> int:
        """Replicas this machine can run now: the current ones plus what the free GPUs allow."""
        need = self.gpus_per_replica
        if need == 0:
            return self.model.spec.scaling.max
        vendor = self.model.spec.resources.gpu.vendor
        vendors = (vendor,) if vendor else self.backend.gpu_vendors
        free = max((sum(1 for s in self.gpus.free if s.vendor == v) for v in vendors), default=0)
        return len(self.replicas) + free // need

    @property
    def gpus_per_replica(self) -> int:
        """`resources.gpu.count`, or one GPU for a GPU backend on a machine that has any."""
        wanted = self.model.spec.resources.gpu.count
        if wanted:
            return wanted
        return 1 if self.backend.gpu_vendors and self.gpus.slots else 0

    def _start_replica(self) -> Replica | None:
        index = next(self._indexes)
        owner = f"{self.model.key}#{index}"
        gpu = self.model.spec.resources.gpu
        slots = self.gpus.allocate(owner, self.gpus_per_replica, self.backend.gpu_vendors, gpu.vendor, gpu.minVramMb)
        if slots is None:
            return None
        port = free_port(self.settings.host)
        name = f"{self.model.name}-{index}"
        used = {r.slot for r in self.replicas}
        slot = next(n for n in itertools.count() if n not in used)
        # argv and environment are filled in once the weights are resolved (_supervise).
        child = Child(name, [], self.settings.log_dir / f"{name}.log", {})
        replica = Replica(index=index, port=port, child=child, gpu_owner=owner, slot=slot)
        self.gpu_slots[owner] = slots
        self.replicas.append(replica)
        replica.task = asyncio.create_task(self._supervise(replica), name=f"replica-{name}")
        return replica

    async def _stop_replica(self, replica: Replica, drain: bool = True) -> None:
        self._stopping += 1
        try:
            # Supervision ends first, so no health probe can mark the replica ready again.
            if replica.task is not None:
                replica.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await replica.task
            was_ready = replica.state is ReplicaState.READY
            replica.state = ReplicaState.STOPPING
            if was_ready:
                self._changed()
                await asyncio.sleep(self.settings.unroute_delay)
            if self.backend.drains_on_sigterm:
                await replica.child.stop(self.settings.stop_grace)
            else:
                if was_ready and drain:
                    await self._drain(replica)
                await replica.child.stop(self.backend.term_grace)
        finally:
            self._stopping -= 1
            self.gpus.release(replica.gpu_owner)
            self.gpu_slots.pop(replica.gpu_owner, None)
        replica.state = ReplicaState.STOPPED
        log.info("replica stopped model=%s replica=%d", self.model.key, replica.index)

    async def _drain(self, replica: Replica) -> None:
        """Wait (at most `stop_grace`) until the engine holds no request: its own load signals, or
        for an engine without any (Ollama) the gateways' in-flight count of the model."""
        deadline = time.monotonic() + self.settings.stop_grace
        async with aiohttp.ClientSession() as session:
            engine = Engine(self.backend, session, self.settings.host, replica.port, self._values(replica), None)
            while time.monotonic() < deadline and replica.child.running:
                if self.backend.load_metrics is not None:
                    load = await engine.load()
                    if load is None or load.queue == 0:
                        return
                elif self.in_flight() == 0:
                    return
                await asyncio.sleep(0.1)
        log.warning("drain incomplete model=%s replica=%d after %.0fs", self.model.key, replica.index,
                    self.settings.stop_grace)

    def publish(self) -> None:
        """Routing-relevant state changed outside a replica (admission, failures)."""
        self._changed()

    def _changed(self) -> None:
        self.generation += 1
        self._note_tier()
        self._on_change()
        if self.hotswap is not None:
            self.hotswap.poke()

    def _activation(self) -> Activation:
        now = time.monotonic()
        timeout = float(self.model.spec.scaling.activationTimeout)
        return Activation(began=now, deadline=now + timeout - activation_margin(timeout))

    async def _supervise(self, replica: Replica) -> None:
        backoff = self.settings.restart_backoff_min
        from_zero = self.model.spec.scaling.min == 0
        activation = replica.activation = self._activation()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while True:
                replica.state = ReplicaState.STARTING
                replica.started_at = time.monotonic()
                replica.healthy_at = replica.loaded_at = replica.first_byte = replica.first_byte_at = None
                replica.weights_at = replica.load = None
                failure, code, exit_code = await self._attempt(replica, session, activation)
                replica.state = ReplicaState.RESTARTING
                replica.ready_at = None
                if failure is None:
                    # It was ready and served, then exited: a restart, not a failed start.
                    replica.restarts += 1
                    if from_zero:
                        # Scale-from-zero models do not restart on their own: the scaler decides
                        # again from demand.
                        self._gone(replica, exit_code, None)
                        return
                    backoff = self.settings.restart_backoff_min
                    self._changed()
                    log.warning("replica exited model=%s replica=%d code=%s restart_in=%.1fs log=%s",
                                self.model.key, replica.index, exit_code, backoff, replica.child.log_path)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, self.settings.restart_backoff_max)
                    activation = replica.activation = self._activation()
                    continue
                if activation.last_failure and time.monotonic() >= activation.deadline:
                    # Cut short by the deadline: the reason worth telling is the failure before it.
                    failure = f"{activation.last_failure}; the attempt after it was still loading when the time ran out"
                activation.failed += 1
                activation.last_failure = failure
                self._attempt_failed(replica, activation, failure)
                self._changed()
                await asyncio.sleep(min(backoff, max(0.0, activation.deadline - time.monotonic())))
                backoff = min(backoff * 2, self.settings.restart_backoff_max)
                if time.monotonic() < activation.deadline:
                    continue
                # The activation's time is up: the held requests get the last attempt's reason.
                timeout = float(self.model.spec.scaling.activationTimeout)
                attempts = "1 attempt" if activation.failed == 1 else f"{activation.failed} attempts"
                given_up = f"{failure} ({attempts} in the {timeout:.0f}s activationTimeout)"
                if from_zero:
                    # A failed activation needs a new activation lease to start again.
                    self._gone(replica, None, given_up, code)
                    return
                # An always-on model keeps trying, in a new activation.
                self._activation_failed(given_up, code)
                activation = replica.activation = self._activation()

    async def _attempt(
        self, replica: Replica, session: aiohttp.ClientSession, activation: Activation
    ) -> tuple[str | None, str, int | None]:
        """One start of the replica's engine, watched until it exits: why the start failed (None:
        the process was ready before it exited), that failure's code, and the exit code."""
        try:
            await self._acquire_weights(replica, activation.deadline)
            await self._acquire_adapters(replica)
        except DeliveryError as exc:
            why = str(exc)
            source = self.model.spec.source or ""
            failure = f"weights unavailable: {why if source in why else f'{source}: {why}'}"
            return failure, contract.WEIGHTS_UNAVAILABLE, None
        if self.model.spec.source is not None:
            # The process starts now: health and load are timed from here.
            replica.weights_at = replica.started_at = time.monotonic()
        try:
            code, reason = await self._run_engine(replica, session, activation.deadline - replica.started_at)
        finally:
            self._release_weights(replica)
        if replica.ready_at is not None:
            return None, "", code
        replica.restarts += 1
        return reason or f"backend exited with code {code} while loading (log: {replica.child.log_path})", "", code

    def _attempt_failed(self, replica: Replica, activation: Activation, reason: str) -> None:
        self.failed_attempts += 1
        self.last_attempt_failure = reason
        left = activation.deadline - time.monotonic()
        log.warning("start attempt failed model=%s replica=%d attempt=%d time_left=%.1fs reason=%s",
                    self.model.key, replica.index, activation.failed, max(0.0, left), reason)
        if self.on_attempt_failed is not None:
            self.on_attempt_failed(self, reason)

    async def _run_engine(
        self, replica: Replica, session: aiohttp.ClientSession, load_timeout: float
    ) -> tuple[int | None, str | None]:
        """Start the engine on the replica's weights (their lease goes to the process) and watch it
        until it exits."""
        values = self._values(replica)
        await asyncio.to_thread(Path(values["state"]).mkdir, parents=True, exist_ok=True)
        replica.child.argv = self._argv(values, replica.adapter_weights)
        replica.child.env = self._env(values, self.gpu_slots.get(replica.gpu_owner, []))
        replica.child.pass_fds = replica.weights.fds if replica.weights is not None else ()
        await replica.child.start()
        if self.on_spawned is not None:
            self.on_spawned(self, replica)
        weights = replica.weights.path if replica.weights is not None else None
        engine = Engine(self.backend, session, self.settings.host, replica.port, values, weights)
        exited = asyncio.ensure_future(replica.child.wait())
        try:
            return await self._watch(replica, engine, exited, load_timeout)
        finally:
            if not exited.done():
                exited.cancel()

    def _gone(self, replica: Replica, code: int | None, failure: str | None, failure_code: str = "") -> None:
        """A replica of a scale-from-zero model ended for good (exit, or weights unavailable)."""
        if failure is not None:
            self._activation_failed(failure, failure_code)
        else:
            log.warning(
                "replica exited model=%s replica=%d code=%s log=%s",
                self.model.key,
                replica.index,
                code,
                replica.child.log_path,
            )
        replica.state = ReplicaState.STOPPED
        self.gpus.release(replica.gpu_owner)
        self.gpu_slots.pop(replica.gpu_owner, None)
        if replica in self.replicas:
            self.replicas.remove(replica)
        self._changed()
        if self.on_exit is not None:
            self.on_exit(self)

    def _activation_failed(self, reason: str, code: str = "") -> None:
        self.failed_activations += 1
        self.last_failure = reason
        self.last_failure_code = code
        log.warning("activation failed model=%s failures=%d code=%s reason=%s", self.model.key,
                    self.failed_activations, code or "-", reason)
        if self.on_activation_failed is not None:
            self.on_activation_failed(self, reason)

    async def _bring_up(self, replica: Replica, engine: Engine) -> None:
        """From "health passes" to "the model is loaded and answers" (raises EngineError)."""
        replica.healthy_at = time.monotonic()
        await engine.prepare()
        replica.prepared_at = time.monotonic()
        if self.backend.load_by_answering:
            sent = time.monotonic()
            replica.first_byte = await engine.answer()
            replica.first_byte_at = sent + replica.first_byte
        deadline = time.monotonic() + 30.0
        while not await engine.loaded():
            if time.monotonic() > deadline:
                raise EngineError(f"the model was not loaded 30s after {self.backend.name}'s load steps")
            await asyncio.sleep(self.settings.probe_interval_loading)
        if self.hotswap is not None:
            await self.hotswap.preload(engine.session, f"{self.settings.host}:{replica.port}")
        replica.loaded_at = time.monotonic()

    async def _watch(
        self,
        replica: Replica,
        engine: Engine,
        exited: asyncio.Future[int],
        load_timeout: float,
    ) -> tuple[int | None, str | None]:
        """Probe until the process exits; returns its exit code and, for a load that never
        completed in time, the reason it was stopped."""
        try:
            return await self._watch_loop(replica, engine, exited, load_timeout)
        finally:
            if replica.probe is not None:
                replica.probe.cancel()
                replica.probe = None

    async def _watch_loop(
        self, replica: Replica, engine: Engine, exited: asyncio.Future[int], load_timeout: float
    ) -> tuple[int | None, str | None]:
        next_health = 0.0
        while not exited.done():
            now = time.monotonic()
            if replica.ready_at is None and now - replica.started_at > load_timeout:
                await replica.child.stop(self.backend.term_grace)
                return exited.result() if exited.done() else None, (
                    f"the model was not loaded and answering within {load_timeout:.0f}s "
                    f"(health {self.backend.health_path}; log: {replica.child.log_path})"
                )
            if replica.state in DORMANT:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(exited), self.settings.probe_interval_ready)
                continue
            if replica.state is not ReplicaState.READY:
                if await engine.healthy():
                    failure = await self._first_of(self._bring_up(replica, engine), exited)
                    if failure is not None:
                        await replica.child.stop(self.backend.term_grace)
                        return exited.result() if exited.done() else None, (
                            f"{failure} (log: {replica.child.log_path})"
                        )
                    if exited.done():
                        break
                    self._became_ready(replica)
                    if self.backend.answer_probe and replica.first_byte is None:
                        replica.probe = asyncio.create_task(self._first_answer(replica, engine))
                    next_health = time.monotonic() + self.settings.probe_interval_ready
            else:
                if now >= next_health:
                    next_health = now + self.settings.probe_interval_ready
                    if not (await engine.healthy() and await engine.loaded()):
                        replica.state = ReplicaState.STARTING
                        replica.load = None
                        log.warning("replica unhealthy model=%s replica=%d", self.model.key, replica.index)
                        self._changed()
                        continue
                await self._read_load(replica, engine)
            interval = (
                min(self.settings.load_interval, self.settings.probe_interval_ready)
                if replica.state is ReplicaState.READY and self.backend.load_metrics is not None
                else self.settings.probe_interval_ready
                if replica.state is ReplicaState.READY
                else self.settings.probe_interval_loading
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(exited), interval)
        return exited.result(), None

    @staticmethod
    async def _first_of(bring_up: Coroutine[Any, Any, None], exited: asyncio.Future[int]) -> str | None:
        """Run the load steps unless the process exits first; their failure, or None."""
        task: asyncio.Future[Any] = asyncio.ensure_future(bring_up)
        await asyncio.wait([task, exited], return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, EngineError):
                await task
            return None
        try:
            task.result()
        except EngineError as exc:
            return str(exc)
        return None

    async def _first_answer(self, replica: Replica, engine: Engine) -> None:
        """One token through the OpenAI API once the replica is routed: the model answers (else
        the replica goes back to loading), and its first byte is the cold start's last stage. It
        waits for the requests held for this wake rather than going before them: on a 409 MB GGUF
        a token asked first cost the held request 140-200 ms (docs/decisions.md)."""
        if self.backend.load_metrics is not None:
            # Requests held for this wake reach the engine within tens of ms of routing: let them
            # have it first, and ask once the engine reports nothing running or waiting.
            await asyncio.sleep(ANSWER_AFTER)
            deadline = time.monotonic() + 30.0
            while time.monotonic() < deadline:
                load = await engine.load()
                if load is None or load.queue == 0:
                    break
                await asyncio.sleep(self.settings.probe_interval_loading)
        try:
            sent = time.monotonic()
            replica.first_byte = await engine.answer()
            replica.first_byte_at = sent + replica.first_byte
        except EngineError as exc:
            if replica.state is ReplicaState.READY:
                log.warning("replica does not answer model=%s replica=%d: %s", self.model.key, replica.index, exc)
                replica.state = ReplicaState.STARTING
                replica.load = None
                self._changed()
            return
        if self.on_answered is not None:
            self.on_answered(self, replica)

    def _became_ready(self, replica: Replica) -> None:
        replica.state = ReplicaState.READY
        replica.ready_at = time.monotonic()
        replica.activation = None
        if replica.adapter_weights and self.backend.lora_arg:
            now = time.time()
            self.adapter_loaded_at.update((a.name, now) for a in self.model.adapters)
        log.info(
            "replica ready model=%s replica=%d port=%d load_seconds=%.2f",
            self.model.key,
            replica.index,
            replica.port,
            replica.ready_at - replica.started_at,
        )
        if self.on_ready is not None:
            self.on_ready(self, replica)
        self._changed()

    async def _read_load(self, replica: Replica, engine: Engine) -> None:
        if self.backend.load_metrics is None:
            return
        load = await engine.load()
        before = replica.load.queue if replica.load is not None else None
        replica.load = load
        if (load.queue if load is not None else None) != before:
            self._on_change()  # new load numbers for picking; not a new backend generation
            if self.hotswap is not None:
                self.hotswap.poke()  # holders may be saturated now


def _size_of(path: Path) -> int:
    """Bytes of a weight file, or of every file under a weight folder."""
    try:
        if path.is_file():
            return path.stat().st_size
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    except OSError:
        return 0


def _host_memory_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None
