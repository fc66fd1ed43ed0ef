"""The local scaler: demand in, replica counts and GPU-group turns out, for `wakegate up`.

Decisions come from the pure modules in control/scaling/ (autoscale per model,
arbitration per GPU group); this module only keeps their state, feeds them the
summed demand from the DemandBook, and applies the result to the runtimes. It
re-evaluates when demand changes, when a replica starts, exits or becomes
ready, and at the earliest time any decision said it could change: no polling
loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from control.demand import DemandBook, ModelLoad
from control.local.runtime import ModelRuntime, Replica
from control.scaling import arbitration, autoscale

log = logging.getLogger("wakegate.up")


@dataclass
class _ModelState:
    scale: autoscale.ScaleState
    #: When the current scale-from-zero began (the activation signal), for cold-start timing.
    waking_since: float | None = None
    spawned_at: float | None = None
    applying: asyncio.Task[None] | None = None
    wanted: int = 0


@dataclass
class _GroupState:
    members: list[arbitration.Member]
    active: str | None = None
    active_since: float | None = None
    states: dict[str, arbitration.MemberState] = field(default_factory=dict)
    swaps: int = 0


class LocalScaler:
    def __init__(
        self,
        runtimes: dict[str, ModelRuntime],
        book: DemandBook,
        *,
        on_cold_start: Callable[[str, str, float], None] = lambda model, stage, seconds: None,
        on_swap: Callable[[str, str | None, str], None] = lambda group, old, new: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runtimes = runtimes
        self.book = book
        self._clock = clock
        self._on_cold_start = on_cold_start
        self._on_swap = on_swap
        self._models: dict[str, _ModelState] = {}
        self._groups: dict[str, _GroupState] = {}
        for key, runtime in runtimes.items():
            spec = runtime.model.spec
            self._models[key] = _ModelState(autoscale.ScaleState(replicas=0))
            runtime.on_spawned = self._spawned
            runtime.on_ready = self._ready
            runtime.on_exit = lambda _rt: self.poke()
            if spec.gpu.shared:
                group = self._groups.setdefault(spec.gpu.shared, _GroupState(members=[]))
                group.members.append(
                    arbitration.Member(
                        key=key,
                        priority=spec.gpu.priority,
                        min_run_seconds=spec.gpu.minRunSeconds,
                        swap_cooldown_seconds=spec.gpu.swapCooldownSeconds,
                        demand_window_seconds=spec.gpu.demandWindowSeconds,
                    )
                )
        self._wake = asyncio.Event()
        self._timer_at: float | None = None
        self.loads: dict[str, ModelLoad] = {}

    @property
    def swaps(self) -> dict[str, int]:
        return {name: group.swaps for name, group in self._groups.items()}

    def group_active(self, name: str) -> str | None:
        return self._groups[name].active

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

    # -- decisions --------------------------------------------------------------------------------

    def _effective(self, key: str, load: ModelLoad | None) -> autoscale.Load:
        if load is None:
            return autoscale.Load()
        runtime = self.runtimes[key]
        # A lease that began before the newest failed activation must not start another one.
        leases = load.leases if load.newest_failures_seen >= runtime.failed_activations else 0
        queued = load.queued if leases or runtime.replica_count else 0
        return autoscale.Load(queued=queued, in_flight=load.in_flight, leases=leases)

    def evaluate(self) -> None:
        now = self._clock()
        self.book.expire(now)
        self.loads = self.book.totals()
        wanted: dict[str, int] = {}
        next_checks: list[float] = []
        expiry = self.book.next_expiry()
        if expiry is not None:
            next_checks.append(expiry)
        demanded: dict[str, bool] = {}
        for key, runtime in self.runtimes.items():
            spec = runtime.model.spec.scaling
            policy = autoscale.Policy(
                min=spec.min, max=spec.max, idle_timeout=float(spec.idleTimeout), target_in_flight=spec.targetInFlight
            )
            state = self._models[key]
            scale = state.scale
            settled = state.applying is None or state.applying.done()
            if settled and scale.replicas != runtime.replica_count:
                # Replicas went away on their own (a failed load of a scale-from-zero model).
                scale = replace(scale, replicas=runtime.replica_count)
            load = self._effective(key, self.loads.get(key))
            demanded[key] = load.queued + load.in_flight + load.leases > 0
            desired, state.scale, next_at = autoscale.decide(policy, load, scale, now)
            wanted[key] = desired
            if next_at is not None:
                next_checks.append(next_at)
        for name, group in self._groups.items():
            next_at = self._arbitrate(name, group, wanted, demanded, now)
            if next_at is not None:
                next_checks.append(next_at)
        for key, count in wanted.items():
            self._apply(key, min(count, self.runtimes[key].capacity), now)
        self._timer_at = min(next_checks) if next_checks else None

    def _arbitrate(
        self, name: str, group: _GroupState, wanted: dict[str, int], demanded: dict[str, bool], now: float
    ) -> float | None:
        """Only the member holding the group may run; `wanted` is cut to 0 for the others."""
        for member in group.members:
            previous = group.states.get(member.key, arbitration.MemberState())
            if demanded[member.key]:
                since = previous.demand_since if previous.demand_since is not None else now
            else:
                since = None
            group.states[member.key] = arbitration.MemberState(
                demand_since=since, swapped_out_at=previous.swapped_out_at
            )
        # The active member going idle releases the group.
        if group.active is not None and wanted[group.active] == 0 and not self.runtimes[group.active].occupied:
            group.active = None
            group.active_since = None
        decision = arbitration.arbitrate(group.members, group.states, group.active, group.active_since, now)
        if decision.active != group.active:
            if decision.swapped_out is not None:
                old = group.states.get(decision.swapped_out, arbitration.MemberState())
                group.states[decision.swapped_out] = arbitration.MemberState(old.demand_since, now)
                group.swaps += 1
            log.info(
                "gpu group turn group=%s from=%s to=%s reason=%s", name, group.active, decision.active, decision.reason
            )
            self._on_swap(name, group.active, decision.active or "")
            group.active = decision.active
            group.active_since = now if decision.active is not None else None
        for member in group.members:
            admitted = member.key == group.active
            runtime = self.runtimes[member.key]
            if runtime.admitted != admitted:
                runtime.admitted = admitted
                runtime.publish()
            if not admitted:
                wanted[member.key] = 0
        # The incoming member starts only once the outgoing one has stopped.
        if group.active is not None and any(
            self.runtimes[m.key].occupied for m in group.members if m.key != group.active
        ):
            wanted[group.active] = min(wanted[group.active], self.runtimes[group.active].replica_count)
        return decision.next_check_at

    def _apply(self, key: str, count: int, now: float) -> None:
        state = self._models[key]
        runtime = self.runtimes[key]
        state.wanted = count
        if count == runtime.replica_count or (state.applying is not None and not state.applying.done()):
            return
        if runtime.replica_count == 0 and count > 0:
            state.waking_since = now
        state.applying = asyncio.create_task(self._scale(key, runtime, state))

    async def _scale(self, key: str, runtime: ModelRuntime, state: _ModelState) -> None:
        try:
            while runtime.replica_count != state.wanted:
                before = runtime.replica_count
                await runtime.scale_to(state.wanted)
                if runtime.replica_count == before:
                    break  # capped (no free GPUs): the next evaluation tries again
        finally:
            self.poke()  # a group peer may be waiting for this one to stop

    # -- cold-start stages ------------------------------------------------------------------------

    def _spawned(self, runtime: ModelRuntime, replica: Replica) -> None:
        state = self._models[runtime.model.key]
        if state.waking_since is not None and state.spawned_at is None:
            state.spawned_at = replica.started_at
            self._on_cold_start(runtime.model.key, "process_start", replica.started_at - state.waking_since)

    def _ready(self, runtime: ModelRuntime, replica: Replica) -> None:
        state = self._models[runtime.model.key]
        if state.waking_since is not None and replica.ready_at is not None:
            self._on_cold_start(runtime.model.key, "health_pass", replica.ready_at - replica.started_at)
            runtime.last_cold_start = replica.ready_at - state.waking_since
            self._on_cold_start(runtime.model.key, "total", runtime.last_cold_start)
            state.waking_since = None
            state.spawned_at = None
        self.poke()
