"""The local scaler: applies the scaling core's verdicts to the processes of `wakegate up`.

Decisions come from `wakegate.control.scaling.core.Core`, the same pure core the cluster scaler uses
(autoscale per model, arbitration per GPU group, fed by the DemandBook); this module only
turns verdicts into replica counts of the runtimes, capped by free GPUs, and times cold-start
stages. It re-evaluates when demand changes, when a replica starts, exits or becomes ready,
and at the earliest time any decision said it could change: no polling loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from wakegate.control.demand.book import DemandBook, ModelLoad
from wakegate.control.scaling.core import Core, Verdict
from wakegate.control.up.predictive import Predictive
from wakegate.control.up.replica import DORMANT, Replica, ReplicaState
from wakegate.control.up.runtime import ModelRuntime

log = logging.getLogger("wakegate.up")


@dataclass
class _Applying:
    #: When the current scale-from-zero began (the activation signal), for cold-start timing.
    waking_since: float | None = None
    spawned: bool = False
    task: asyncio.Task[None] | None = None
    wanted: int = 0
    #: The replica of the last wake and its activation time, until its first answer is timed.
    answer_from: tuple[Replica, float] | None = None


class LocalScaler:
    def __init__(
        self,
        runtimes: dict[str, ModelRuntime],
        book: DemandBook,
        *,
        on_cold_start: Callable[[str, str, float], None] = lambda model, stage, seconds: None,
        on_swap: Callable[[str, str | None, str], None] = lambda group, old, new: None,
        on_tier: Callable[[ModelRuntime], None] = lambda runtime: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runtimes = runtimes
        self.core = Core(book)
        self._clock = clock
        self._on_cold_start = on_cold_start
        self._on_swap = on_swap
        self._on_tier = on_tier
        self._applying = {key: _Applying() for key in runtimes}
        self._holders: dict[str, str | None] = {}
        for runtime in runtimes.values():
            runtime.on_spawned = self._spawned
            runtime.on_ready = self._ready
            runtime.on_exit = self._exited
            runtime.on_answered = self._answered
            runtime.on_tier = self._tier_changed
        self.core.set_models([rt.model for rt in runtimes.values()], clock(), {key: 0 for key in runtimes})
        self._wake = asyncio.Event()
        self._timer_at: float | None = None
        #: Predictive wake (control/up/predictive.py), set by `up` when a model enables it.
        self.predictive: Predictive | None = None

    @property
    def loads(self) -> dict[str, ModelLoad]:
        return self.core.loads

    @property
    def swaps(self) -> dict[str, int]:
        return self.core.swaps

    def group_active(self, name: str) -> str | None:
        return self.core.group_active(name)

    def poke(self) -> None:
        """Something changed: evaluate on the next loop turn."""
        self._wake.set()

    async def run(self) -> None:
        while True:
            timeout = None if self._timer_at is None else max(0.0, self._timer_at - self._clock())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()
            self.evaluate()

    def evaluate(self) -> None:
        now = self._clock()
        # A sleeping replica holds no accelerator: a GPU-group peer may start beside it.
        live = {key: rt.awake_count for key, rt in self.runtimes.items()}
        failures = {key: rt.failed_activations for key, rt in self.runtimes.items()}
        verdicts, self._timer_at = self.core.evaluate(now, live, failures)
        self._log_group_turns()
        for key, verdict in verdicts.items():
            runtime = self.runtimes[key]
            if runtime.admitted != verdict.admitted:
                runtime.admitted = verdict.admitted
                runtime.publish()
            runtime.waiting_for = verdict.waiting_for
            if runtime.can_sleep and self._tier(runtime, verdict, now):
                continue
            self._apply(key, min(verdict.replicas, runtime.capacity), now)
        if self.predictive is not None:
            at = self.predictive.evaluate(verdicts, now)
            if at is not None:
                self._timer_at = at if self._timer_at is None else min(self._timer_at, at)
            if self.predictive.started:
                self.poke()  # its lease counts from the next evaluation

    def _tier(self, runtime: ModelRuntime, verdict: Verdict, now: float) -> bool:
        """The asleep tier of a model whose engine can sleep: True when it was sent to sleep (its
        replicas stay), False when the verdict's count applies (woken first if it slept)."""
        if verdict.own_replicas == 0 or not runtime.replicas:
            return False  # zero: idle for idleTimeout (stops sleeping replicas too), or nothing runs
        sleepable = all(r.state is ReplicaState.READY or r.state in DORMANT for r in runtime.replicas)
        if verdict.replicas == 0:
            # Its GPU group went to a peer: sleep instead of stopping, where memory allows.
            if sleepable and not runtime.sleep_refused:
                runtime.want_asleep(True)
                return True
            return False
        sleep_after = runtime.model.spec.scaling.sleepAfter
        idle_since = verdict.idle_since
        if sleep_after is not None and idle_since is not None and not verdict.busy:
            sleep_at = idle_since + sleep_after
            if now >= sleep_at:
                if sleepable:
                    runtime.want_asleep(True)
                    return True
            else:
                self._timer_at = sleep_at if self._timer_at is None else min(self._timer_at, sleep_at)
        if runtime.asleep_count:
            runtime.want_asleep(False, asked=now)
        return False

    def _log_group_turns(self) -> None:
        for name in self.core.swaps:
            holder = self.core.group_active(name)
            previous = self._holders.get(name)
            if holder != previous:
                log.info("gpu group turn group=%s from=%s to=%s", name, previous, holder)
                self._on_swap(name, previous, holder or "")
                self._holders[name] = holder

    def _apply(self, key: str, count: int, now: float) -> None:
        state = self._applying[key]
        runtime = self.runtimes[key]
        state.wanted = count
        busy = state.task is not None and not state.task.done()
        if runtime.replica_count == 0 and count > 0 and not (busy and state.waking_since is not None):
            # A wake from zero, timed from this demand. Demand that comes while the last replica
            # is still being stopped is a wake too: the running task starts the replica once the
            # stop is done (it follows `wanted`), and the wake counts from here.
            state.waking_since = now
            state.spawned = False
        if count == runtime.replica_count or busy:
            return
        state.task = asyncio.create_task(self._scale(runtime, state))

    async def _scale(self, runtime: ModelRuntime, state: _Applying) -> None:
        try:
            while runtime.replica_count != state.wanted:
                before = runtime.replica_count
                await runtime.scale_to(state.wanted)
                if runtime.replica_count == before:
                    break  # capped (no free GPUs): the next evaluation tries again
        finally:
            self.poke()  # a group peer may be waiting for this one to stop

    # -- replica events ---------------------------------------------------------------------------

    def _tier_changed(self, runtime: ModelRuntime) -> None:
        self._on_tier(runtime)
        self.poke()

    def _exited(self, runtime: ModelRuntime) -> None:
        """A replica went away on its own (failed load of a scale-from-zero model)."""
        self.core.resync(runtime.model.key, runtime.replica_count)
        self.poke()

    def _spawned(self, runtime: ModelRuntime, replica: Replica) -> None:
        state = self._applying[runtime.model.key]
        if state.waking_since is not None and not state.spawned:
            state.spawned = True
            self._on_cold_start(runtime.model.key, "process_start", replica.started_at - state.waking_since)

    def _answered(self, runtime: ModelRuntime, replica: Replica) -> None:
        state = self._applying[runtime.model.key]
        if state.answer_from is None or state.answer_from[0] is not replica:
            return
        _, t0 = state.answer_from
        state.answer_from = None
        if replica.first_byte is not None and replica.first_byte_at is not None:
            runtime.last_timeline["first_byte"] = replica.first_byte_at - t0
            self._on_cold_start(runtime.model.key, "first_byte", replica.first_byte)

    def _ready(self, runtime: ModelRuntime, replica: Replica) -> None:
        state = self._applying[runtime.model.key]
        if state.waking_since is not None and replica.ready_at is not None:
            key, t0 = runtime.model.key, state.waking_since
            healthy = replica.healthy_at or replica.ready_at
            loaded = replica.loaded_at or replica.ready_at
            # Seconds since the activation signal (the demand that woke the model) of each stage;
            # first_byte follows when the engine's first answer comes (_answered).
            runtime.last_timeline = {
                **({"weights": replica.weights_at - t0} if replica.weights_at is not None else {}),
                "process_start": replica.started_at - t0,
                "health_pass": healthy - t0,
                **({"prepared": replica.prepared_at - t0} if replica.prepared_at and runtime.backend.prepare else {}),
                "model_loaded": loaded - t0,
                "ready": replica.ready_at - t0,
            }
            if replica.weights_at is not None:
                self._on_cold_start(key, "weights", replica.weights_at - t0)
            self._on_cold_start(key, "health_pass", healthy - replica.started_at)
            self._on_cold_start(key, "model_loaded", loaded - replica.started_at)
            runtime.last_cold_start = replica.ready_at - t0
            self._on_cold_start(key, "total", runtime.last_cold_start)
            state.waking_since = None
            state.answer_from = (replica, t0)
            if replica.first_byte is not None:  # answered before routing (load_by_answering)
                self._answered(runtime, replica)
        self.poke()
