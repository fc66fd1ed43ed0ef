"""Replica count for one model: wake from zero, scale out, scale in, idle to min.

This module owns the desired replica count of one model from its
``spec.scaling`` knobs (:class:`Policy`) and its current load (:class:`Load`,
summed over gateways by the caller). It is pure: the caller passes ``now``
(monotonic seconds) and the :class:`ScaleState` returned by the previous call,
stores the new state, and calls again on every load change and at the returned
``next_check_at``. Who turns the count into processes or pods is not its concern.

``ScaleState.replicas`` is the count returned last time (the desired count), not
the live one: the over/under windows are measured against it, so a caller that
passes a live count lagging behind a change (replicas still starting or
stopping) restarts those windows on every call until the runtime catches up.

Definitions (per call)
----------------------
* ``demand = queued + in_flight``; ``need = ceil(demand / target_in_flight)``.
* busy: ``demand > 0`` or ``leases > 0``. A live activation lease wants the
  model up even before its first request arrives.
* over: ``demand > target_in_flight * replicas``; under: ``need < replicas``.

Rules
-----
1. Bounds: a count outside ``[min, max]`` (e.g. the policy just changed) is
   clamped at once.
2. Wake: ``replicas == 0`` and busy -> 1 at once. A cold request is waiting, so
   no window applies to 0 -> 1.
3. Scale out: over continuously for ``scale_out_window`` -> ``min(need, max)``,
   in one step (need is what the current demand asks for).
4. Scale in: under continuously for ``scale_in_window`` -> step down to
   ``max(min, need, 1)``. Scale-in never goes to zero, and since
   ``need >= ceil(in_flight / target_in_flight)`` it never drops below what the
   requests in flight need.
5. Idle: not busy (no queued, no in-flight, no lease) continuously for
   ``idle_timeout`` -> ``min``, which may be 0 (scale to zero). Exactly at
   ``idle_since + idle_timeout``, not before.

The since-markers (``idle_since``, ``over_since``, ``under_since``) record when
each condition started to hold; a condition that stops holding clears its
marker. over and under are relative to the replica count, so whenever the
count changes they restart at ``now`` (if they still hold for the new count):
each step, up or down, needs its own full window. That is what keeps the count
from oscillating: after any change, the next step down is at least
``scale_in_window`` later. ``idle_since`` does not depend on the count and is
not restarted.

Windows of 0 act at once. Rules are applied until the count is stable, so a
wake and an immediate scale-out land in one decision, and calling again with
the returned state at the same ``now`` returns the same count.

Thresholds are compared as ``now >= since + window`` (the value given as
``next_check_at``), so a call exactly at ``next_check_at`` sees it crossed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from wakegate.control.scaling.checks import require_non_negative

__all__ = ["Load", "Policy", "ScaleState", "decide"]


@dataclass(frozen=True, slots=True)
class Policy:
    """``spec.scaling`` of one model; times in seconds."""

    min: int
    max: int
    idle_timeout: float = 300
    target_in_flight: int = 8
    scale_out_window: float = 2.0
    scale_in_window: float = 30.0

    def __post_init__(self) -> None:
        if not 0 <= self.min <= self.max or self.max < 1:
            raise ValueError(f"need 0 <= min <= max and max >= 1, got min={self.min} max={self.max}")
        if self.target_in_flight < 1:
            raise ValueError(f"target_in_flight must be >= 1, got {self.target_in_flight}")
        require_non_negative(self, ("idle_timeout", "scale_out_window", "scale_in_window"))


@dataclass(frozen=True, slots=True)
class Load:
    """Load of one model summed over gateways: held cold requests, requests being served, live leases."""

    queued: int = 0
    in_flight: int = 0
    leases: int = 0

    def __post_init__(self) -> None:
        if self.queued < 0 or self.in_flight < 0 or self.leases < 0:
            raise ValueError(f"load counts must be >= 0, got {self}")


@dataclass(frozen=True, slots=True)
class ScaleState:
    """Desired replica count from the previous decision, and when each condition started to hold."""

    replicas: int
    idle_since: float | None = None
    over_since: float | None = None
    under_since: float | None = None

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {self.replicas}")


def _since(holds: bool, since: float | None, now: float) -> float | None:
    if not holds:
        return None
    return now if since is None else since


def _markers(policy: Policy, load: Load, state: ScaleState, now: float, *, restart: bool) -> ScaleState:
    """The state's markers brought up to date with this load (``restart``: the count just changed)."""
    demand = load.queued + load.in_flight
    need = math.ceil(demand / policy.target_in_flight)
    busy = demand > 0 or load.leases > 0
    over = demand > policy.target_in_flight * state.replicas
    under = need < state.replicas
    return ScaleState(
        replicas=state.replicas,
        idle_since=_since(not busy, state.idle_since, now),
        over_since=_since(over, None if restart else state.over_since, now),
        under_since=_since(under, None if restart else state.under_since, now),
    )


def _step(policy: Policy, load: Load, state: ScaleState, now: float) -> int:
    """One rule application to an up-to-date state: the count it asks for."""
    demand = load.queued + load.in_flight
    need = math.ceil(demand / policy.target_in_flight)
    busy = demand > 0 or load.leases > 0
    current = state.replicas
    if not policy.min <= current <= policy.max:
        return min(max(current, policy.min), policy.max)
    if current == 0:
        return 1 if busy else 0
    idle_since = state.idle_since
    if idle_since is not None and policy.min < current and now >= idle_since + policy.idle_timeout:
        return policy.min
    if state.over_since is not None and now >= state.over_since + policy.scale_out_window:
        return max(current, min(need, policy.max))
    if state.under_since is not None and now >= state.under_since + policy.scale_in_window:
        return min(current, max(policy.min, need, 1))
    return current


def _next_check(policy: Policy, load: Load, state: ScaleState) -> float | None:
    """Earliest time a marker's window ends in a way that would change the count."""
    need = math.ceil((load.queued + load.in_flight) / policy.target_in_flight)
    times: list[float] = []
    if state.idle_since is not None and policy.min < state.replicas:
        times.append(state.idle_since + policy.idle_timeout)
    if state.over_since is not None and min(need, policy.max) > state.replicas:
        times.append(state.over_since + policy.scale_out_window)
    if state.under_since is not None and max(policy.min, need, 1) < state.replicas:
        times.append(state.under_since + policy.scale_in_window)
    return min(times, default=None)


def decide(policy: Policy, load: Load, state: ScaleState, now: float) -> tuple[int, ScaleState, float | None]:
    """Desired replicas at ``now``, the state to pass next time, and when to call again without a load change.

    ``next_check_at`` is None when only a load change can change the count.
    """
    state = _markers(policy, load, state, now, restart=False)
    # Each change restarts over/under, so with windows > 0 this settles after one change; windows of 0
    # can chain bounds -> wake -> scale out. Counts only move monotonically within one call, so a few
    # rounds always suffice; the bound is a guard, not a tuning knob.
    for _ in range(4):
        desired = _step(policy, load, state, now)
        if desired == state.replicas:
            break
        state = _markers(policy, load, ScaleState(desired, state.idle_since), now, restart=True)
    return state.replicas, state, _next_check(policy, load, state)
