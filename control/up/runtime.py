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

A replica's own record is in replica.py; what its engine is started with (weights, adapters,
arguments, environment) in launch.py; the idle tiers (asleep, waking) in tiers.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

import aiohttp

from wakegate import contract
from wakegate.control.admin import free_port
from wakegate.control.backends import BACKENDS
from wakegate.control.delivery.cache import default_cache_dir
from wakegate.control.delivery.errors import DeliveryError
from wakegate.control.delivery.resolver import Access
from wakegate.control.demand.book import AdapterLoad
from wakegate.control.feeder.routed import RoutedModel, routed_adapters, routed_model
from wakegate.control.local.children import Child
from wakegate.control.schema import Model
from wakegate.control.up.engine import Engine, EngineError
from wakegate.control.up.gpus import GpuPool, Slot
from wakegate.control.up.hotswap import HotSwap
from wakegate.control.up.launch import ReplicaLaunch
from wakegate.control.up.replica import (
    DORMANT,
    Activation,
    Replica,
    ReplicaState,
    RuntimeSettings,
    Tier,
    activation_margin,
)
from wakegate.control.up.tiers import IdleTiers
from wakegate.control.up.weights import Delivery, DeliveryConfig, WeightsWatch

log = logging.getLogger("wakegate.up")

#: After routing a new replica, how long its first answer check waits before looking at the
#: engine's load (held requests arrive within ~40 ms, docs/performance.md "Cold starts").
ANSWER_AFTER = 0.1


class ModelRuntime(IdleTiers, ReplicaLaunch):
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
        #: Replicas taken out of `replicas` and being stopped (unrouted, drained, signalled).
        self._stopping: list[Replica] = []
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
    def replica_count(self) -> int:
        """Replicas the model is meant to have (starting, ready or restarting)."""
        return len(self.replicas)

    @property
    def live_count(self) -> int:
        """Processes of this model that exist, including replicas being stopped."""
        return len(self.replicas) + len(self._stopping)

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
        # Replicas a scale-down is still stopping too: their task may not get to signal them before
        # `up` exits, and a process that only dies with its parent leaves its own children behind
        # (Ollama's runner).
        await asyncio.gather(
            *(self._stop_replica(r, drain=False) for r in self.replicas),
            *(r.child.stop(self.backend.term_grace) for r in list(self._stopping)),
        )
        self.replicas.clear()
        if self.hotswap is not None:
            self.hotswap.close()

    # -- replicas ---------------------------------------------------------------------------------

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
        kv = self.model.spec.routing.kvEvents
        # An engine publishing KV events binds port + their offsets too: handed out with the port.
        port = free_port(self.settings.host, (kv.portOffset, kv.replayPortOffset) if kv is not None else ())
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
        self._stopping.append(replica)
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
            self._stopping.remove(replica)
            if replica.child.running:
                # Cancelled (or failed) before the process was stopped: it must not outlive this.
                replica.child.kill()
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
