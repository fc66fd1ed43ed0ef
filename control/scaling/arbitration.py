"""GPU-group arbitration: which member of a ``spec.gpu.shared`` group holds the GPU, and when it swaps.

Models that share a GPU group never run at the same time. This module owns the
decision of which member is (or becomes) the active one, from plain values.
The runtime owns everything else: stopping the swapped-out member, holding the
requests of a waiting member and flushing them once it is ready, and keeping
the time markers read here.

Rules
-----
Each member carries ``priority`` (higher wins), ``min_run_seconds``,
``swap_cooldown_seconds``, ``demand_window_seconds`` and ``queue_threshold``
(from ``spec.gpu``).

* Free group (``active is None``): the best demanded member becomes active at
  once. Neither demand window, cooldown nor queue threshold applies: nothing is
  displaced.
* Active member A, demanded candidate B != A with ``B.priority >= A.priority``:
  B takes over iff, at ``now``, all of

  - ``now >= active_since + A.min_run_seconds``
  - ``now >= B.demand_since + B.demand_window_seconds``
  - ``B.swapped_out_at is None`` or ``now >= B.swapped_out_at + B.swap_cooldown_seconds``
  - ``B.demand >= B.queue_threshold`` (its requests waiting or in flight, over all
    gateways, at ``now``); a threshold of 1, the default, is met by any demand,
    even a lone activation lease

  The threshold is a level, not a time: a candidate held back only by it gets
  no ``next_check_at`` (only more demand can change it, and the caller calls
  again on every demand change), and the demand window still counts from the
  start of its demand, not from the moment the threshold was reached.

  Whether A itself still has demand does not matter (one rule): an idle A is
  still protected by its min run, and releases the group by idling anyway.
* ``B.priority < A.priority``: B never preempts. It waits until the group is
  released: the active member going idle and scaling to zero releases it, and
  the caller reports that by passing ``active=None``. A release is not a swap
  and does not set ``swapped_out_at``.
* Best member, wherever several qualify: highest priority, then the earliest
  start of continuous demand, then the key, so the outcome is deterministic.
* A member that became active at ``now`` is never displaced at that same
  ``now``. This only bites when ``min_run_seconds`` and
  ``swap_cooldown_seconds`` are both 0: a runtime that re-arbitrates right after
  applying a swap would otherwise flip between two members without time passing.

Thresholds are compared as ``now >= marker + seconds`` rather than
``now - marker >= seconds``: ``next_check_at`` is that very sum, so a call made
exactly at ``next_check_at`` is guaranteed to see the threshold crossed, where
float subtraction could land one ulp short.

What the caller keeps
---------------------
* ``MemberState.demand_since``: start of the member's current continuous demand
  (held cold requests, in-flight requests or a live activation lease), ``None``
  while it has none. A swap does not reset it: a swapped-out member whose
  requests are still held keeps demanding.
* ``MemberState.demand``: its demand now (requests held or in flight); read
  only against ``queue_threshold``.
* ``MemberState.swapped_out_at``: when the member was last named by
  ``Decision.swapped_out``. Not set on release.
* ``active`` and ``active_since``: the member holding the group and the time of
  the decision that gave it the group (not when its replica became ready), so
  the min run counts from the hand-over.

Applying a decision
-------------------
When ``Decision.active`` differs from the ``active`` passed in, the caller sets
``active_since = now`` and, for ``Decision.swapped_out``, ``swapped_out_at = now``.
``Decision.next_check_at`` is computed for that updated state: the earliest
future time at which the decision could change with no input change. The
caller calls again on every demand change and at ``next_check_at``; no polling.

:func:`simulate` drives :func:`arbitrate` over a demand timeline the way a
runtime would, to predict activations and swaps (tests, integration checks).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Literal

from wakegate.control.scaling.checks import require_non_negative

__all__ = [
    "Decision",
    "DemandTimeline",
    "Member",
    "MemberState",
    "Reason",
    "SwapEvent",
    "Transition",
    "arbitrate",
    "simulate",
]


@dataclass(frozen=True, slots=True)
class Member:
    """One model of a GPU group, with its ``spec.gpu`` knobs (seconds)."""

    key: str
    priority: int = 0
    min_run_seconds: float = 30
    swap_cooldown_seconds: float = 60
    demand_window_seconds: float = 5
    queue_threshold: int = 1

    def __post_init__(self) -> None:
        require_non_negative(
            self, ("min_run_seconds", "swap_cooldown_seconds", "demand_window_seconds"), f"member {self.key!r}: "
        )
        if self.queue_threshold < 1:
            raise ValueError(f"member {self.key!r}: queue_threshold must be >= 1, got {self.queue_threshold!r}")


@dataclass(frozen=True, slots=True)
class MemberState:
    """Time markers the caller keeps per member (see the module docstring)."""

    demand_since: float | None = None
    swapped_out_at: float | None = None
    demand: int = 0

    def meets(self, threshold: int) -> bool:
        """Whether this demand reaches a queue threshold (1: any demand at all)."""
        return self.demand_since is not None and (threshold <= 1 or self.demand >= threshold)


class Reason(StrEnum):
    """Why a :class:`Decision` came out as it did (stable strings, for logs and tests)."""

    IDLE = "idle"  # group free, nobody demands it
    ACTIVATED = "activated"  # group was free, the best demanded member takes it
    SWAPPED = "swapped"  # a candidate displaces the active member
    KEPT = "kept"  # active member stays; no candidate can take over without an input change
    WAITING = "waiting"  # active member stays; a candidate becomes eligible at next_check_at


@dataclass(frozen=True, slots=True)
class Decision:
    """Who holds the group after this decision, whom it displaced, and when to look again."""

    active: str | None
    swapped_out: str | None
    reason: str
    next_check_at: float | None


_NO_STATE = MemberState()


def _index(members: Sequence[Member]) -> dict[str, Member]:
    by_key: dict[str, Member] = {}
    for member in members:
        if member.key in by_key:
            raise ValueError(f"duplicate group member {member.key!r}")
        by_key[member.key] = member
    return by_key


def _rank(member: Member, demand_since: float) -> tuple[int, float, str]:
    # min() of this is the best member: highest priority, longest waiting, then key.
    return (-member.priority, demand_since, member.key)


def _scan(
    members: Iterable[Member],
    states: Mapping[str, MemberState],
    active: Member,
    active_since: float,
    now: float,
) -> tuple[list[tuple[Member, float]], float | None]:
    """Candidates that may take over from ``active`` now, and the earliest time another one could."""
    eligible: list[tuple[Member, float]] = []
    pending: float | None = None
    for member in members:
        if member.key == active.key or member.priority < active.priority:
            continue
        state = states.get(member.key, _NO_STATE)
        if state.demand_since is None or not state.meets(member.queue_threshold):
            continue
        at = max(active_since + active.min_run_seconds, state.demand_since + member.demand_window_seconds)
        if state.swapped_out_at is not None:
            at = max(at, state.swapped_out_at + member.swap_cooldown_seconds)
        if at <= now and now > active_since:
            eligible.append((member, state.demand_since))
            continue
        if at <= now:
            # Only the same-instant guard holds it back: any later time will do.
            at = math.nextafter(now, math.inf)
        pending = at if pending is None else min(pending, at)
    return eligible, pending


def arbitrate(
    members: Sequence[Member],
    states: Mapping[str, MemberState],
    active: str | None,
    active_since: float | None,
    now: float,
) -> Decision:
    """Decide which member holds the group at ``now``.

    ``states`` may omit members (no demand, never swapped out); keys that are not
    members are ignored. ``active_since`` is ignored when ``active`` is None.
    Raises ValueError for duplicate member keys, an ``active`` that is not a
    member, or an ``active`` without ``active_since``.
    """
    by_key = _index(members)
    if active is None:
        demanded = [
            (m, s.demand_since) for m in members if (s := states.get(m.key, _NO_STATE)).demand_since is not None
        ]
        if not demanded:
            return Decision(None, None, Reason.IDLE, None)
        best = min(demanded, key=lambda c: _rank(*c))[0]
        _, next_check = _scan(members, states, best, now, now)
        return Decision(best.key, None, Reason.ACTIVATED, next_check)

    current = by_key.get(active)
    if current is None:
        raise ValueError(f"active member {active!r} is not in the group")
    if active_since is None:
        raise ValueError(f"active member {active!r} needs active_since")
    eligible, next_check = _scan(members, states, current, active_since, now)
    if not eligible:
        return Decision(active, None, Reason.KEPT if next_check is None else Reason.WAITING, next_check)
    best = min(eligible, key=lambda c: _rank(*c))[0]
    after = dict(states)
    after[active] = replace(states.get(active, _NO_STATE), swapped_out_at=now)
    _, next_check = _scan(members, after, best, now, now)
    return Decision(best.key, active, Reason.SWAPPED, next_check)


# --- simulation --------------------------------------------------------------------------------

Transition = tuple[float, str, bool]
"""``(time, key, demanded)``: from ``time`` on, member ``key`` has demand (True) or not (False)."""

DemandTimeline = Callable[[float], Iterable[str]] | Sequence[Transition]
"""Either a function from time to the keys demanded then, or a list of :data:`Transition`."""


@dataclass(frozen=True, slots=True)
class SwapEvent:
    """A change of the group's holder: ``previous`` -> ``active`` at ``time``."""

    time: float
    kind: Literal["activate", "swap", "release"]
    active: str | None
    previous: str | None


def _demand_at(timeline: DemandTimeline, keys: Mapping[str, Member]) -> Callable[[float], set[str]]:
    if callable(timeline):
        fn = timeline

        def from_function(t: float) -> set[str]:
            return set(fn(t))

        return from_function

    # sorted() is stable: transitions at the same time apply in the order given.
    transitions = sorted(timeline, key=lambda tr: tr[0])
    for _, key, _ in transitions:
        if key not in keys:
            raise ValueError(f"demand timeline names {key!r}, not a group member")
    demanded: set[str] = set()
    position = 0

    def from_transitions(t: float) -> set[str]:
        # Called with non-decreasing t only (simulate steps forward).
        nonlocal position
        while position < len(transitions) and transitions[position][0] <= t:
            _, key, on = transitions[position]
            if on:
                demanded.add(key)
            else:
                demanded.discard(key)
            position += 1
        return set(demanded)

    return from_transitions


def simulate(
    members: Sequence[Member],
    demand_timeline: DemandTimeline,
    step: float,
    until: float,
    *,
    start: float = 0.0,
    release_after: float | None = None,
) -> list[SwapEvent]:
    """Run :func:`arbitrate` at ``start, start + step, ...`` up to ``until`` and record every change.

    At each tick, as a runtime would: demand markers are updated from the
    timeline (``demand_since`` set when demand starts, cleared when it stops);
    with ``release_after`` set, an active member without demand for that long
    releases the group (its idle timeout: it scales to zero); then the group is
    arbitrated and the decision applied (``active_since``, ``swapped_out_at``).
    Demand changes between ticks are seen at the next tick. With
    ``release_after=None`` the active member is never released.
    """
    if not step > 0:
        raise ValueError(f"step must be > 0, got {step!r}")
    by_key = _index(members)
    demand_at = _demand_at(demand_timeline, by_key)
    states = {key: MemberState() for key in by_key}
    active: str | None = None
    active_since: float | None = None
    idle_since: float | None = None
    events: list[SwapEvent] = []
    tick = 0
    # start + tick * step rather than repeated addition: no drift over long runs.
    while (now := start + tick * step) <= until:
        tick += 1
        demanded = demand_at(now)
        unknown = demanded - by_key.keys()
        if unknown:
            raise ValueError(f"demand timeline names {sorted(unknown)}, not group members")
        for key, state in states.items():
            if key in demanded and state.demand_since is None:
                states[key] = replace(state, demand_since=now)
            elif key not in demanded and state.demand_since is not None:
                states[key] = replace(state, demand_since=None)

        if active is not None and release_after is not None:
            if states[active].demand_since is not None:
                idle_since = None
            elif idle_since is None:
                idle_since = now
            if idle_since is not None and now >= idle_since + release_after:
                events.append(SwapEvent(now, "release", None, active))
                active, active_since, idle_since = None, None, None

        decision = arbitrate(members, states, active, active_since, now)
        if decision.active == active:
            continue
        if decision.swapped_out is not None:
            states[decision.swapped_out] = replace(states[decision.swapped_out], swapped_out_at=now)
        kind: Literal["activate", "swap"] = "activate" if active is None else "swap"
        events.append(SwapEvent(now, kind, decision.active, active))
        active, active_since, idle_since = decision.active, now, None
    return events
