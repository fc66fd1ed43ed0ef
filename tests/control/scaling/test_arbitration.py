"""GPU-group arbitration: a table per rule, then properties (one holder, no thrashing, no preemption)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wakegate.control.scaling.arbitration import (
    Decision,
    Member,
    MemberState,
    Reason,
    SwapEvent,
    arbitrate,
    simulate,
)

# Default knobs: min run 30, cooldown 60, demand window 5.
A = Member("a")
B = Member("b")
C = Member("c")
HIGH = Member("high", priority=5)
LOW = Member("low", priority=-1)
GROUP = (A, B, C, HIGH, LOW)


def demand(since: float, swapped_out_at: float | None = None) -> MemberState:
    return MemberState(demand_since=since, swapped_out_at=swapped_out_at)


# id, members, states, active, active_since, now, expected
Row = tuple[str, tuple[Member, ...], dict[str, MemberState], str | None, float | None, float, Decision]
TABLE: list[Row] = [
    # --- free group
    ("free-no-demand", GROUP, {}, None, None, 100, Decision(None, None, Reason.IDLE, None)),
    (
        "free-swapped-out-only-no-demand",
        GROUP,
        {"a": MemberState(swapped_out_at=99)},
        None,
        None,
        100,
        Decision(None, None, Reason.IDLE, None),
    ),
    (
        "free-activates-at-once-no-window",
        GROUP,
        {"b": demand(100)},
        None,
        None,
        100,
        Decision("b", None, Reason.ACTIVATED, None),
    ),
    (
        "free-ignores-cooldown",
        GROUP,
        {"b": demand(100, swapped_out_at=99)},
        None,
        None,
        100,
        Decision("b", None, Reason.ACTIVATED, None),
    ),
    (
        "free-ignores-active-since",
        GROUP,
        {"b": demand(100)},
        None,
        42.0,
        100,
        Decision("b", None, Reason.ACTIVATED, None),
    ),
    (
        "free-priority-beats-earlier-demand",
        GROUP,
        {"a": demand(0), "high": demand(99)},
        None,
        None,
        100,
        # a may never take over from high: nothing pending.
        Decision("high", None, Reason.ACTIVATED, None),
    ),
    (
        "free-tie-earliest-demand",
        GROUP,
        {"b": demand(90), "a": demand(95)},
        None,
        None,
        100,
        # a is eligible once b has run 30 s (its window and cooldown are already fine).
        Decision("b", None, Reason.ACTIVATED, 130),
    ),
    (
        "free-tie-key",
        GROUP,
        {"b": demand(90), "a": demand(90)},
        None,
        None,
        100,
        Decision("a", None, Reason.ACTIVATED, 130),
    ),
    (
        "free-pending-window-after-min-run",
        (A, Member("b", demand_window_seconds=50)),
        {"a": demand(99), "b": demand(100)},
        None,
        None,
        100,
        Decision("a", None, Reason.ACTIVATED, 150),
    ),
    # --- equal priority
    (
        "equal-swaps-after-min-run-and-window",
        GROUP,
        {"b": demand(20)},
        "a",
        0,
        30,
        Decision("b", "a", Reason.SWAPPED, None),
    ),
    (
        "equal-before-min-run",
        GROUP,
        {"b": demand(0)},
        "a",
        0,
        29.9,
        Decision("a", None, Reason.WAITING, 30),
    ),
    (
        "equal-before-window",
        GROUP,
        {"b": demand(37)},
        "a",
        0,
        40,
        Decision("a", None, Reason.WAITING, 42),
    ),
    (
        "equal-window-exactly-met",
        GROUP,
        {"b": demand(37)},
        "a",
        0,
        42,
        Decision("b", "a", Reason.SWAPPED, None),
    ),
    (
        "active-without-demand-still-gets-min-run",
        GROUP,
        {"b": demand(0)},
        "a",
        10,
        20,
        Decision("a", None, Reason.WAITING, 40),
    ),
    (
        "active-demanded-is-swapped-all-the-same",
        GROUP,
        {"a": demand(0), "b": demand(0)},
        "a",
        0,
        30,
        # a keeps demanding: it may come back after its cooldown (60 s from the swap).
        Decision("b", "a", Reason.SWAPPED, 90),
    ),
    # --- cooldown
    (
        "cooldown-blocks-swap-back",
        GROUP,
        {"b": demand(11, swapped_out_at=10)},
        "a",
        10,
        45,
        Decision("a", None, Reason.WAITING, 70),
    ),
    (
        "cooldown-over",
        GROUP,
        {"b": demand(11, swapped_out_at=10)},
        "a",
        10,
        70,
        Decision("b", "a", Reason.SWAPPED, None),
    ),
    (
        "cooldown-of-active-is-irrelevant",
        GROUP,
        {"a": MemberState(swapped_out_at=0), "b": demand(0)},
        "a",
        1,
        31,
        Decision("b", "a", Reason.SWAPPED, None),
    ),
    # --- priorities
    (
        "lower-never-preempts",
        GROUP,
        {"low": demand(0)},
        "a",
        0,
        10_000,
        Decision("a", None, Reason.KEPT, None),
    ),
    (
        "lower-never-preempts-idle-higher",
        GROUP,
        {"a": demand(0), "b": demand(0)},
        "high",
        0,
        10_000,
        Decision("high", None, Reason.KEPT, None),
    ),
    (
        "higher-waits-for-min-run",
        GROUP,
        {"a": demand(0), "high": demand(0)},
        "a",
        0,
        29,
        Decision("a", None, Reason.WAITING, 30),
    ),
    (
        "higher-preempts-after-min-run",
        GROUP,
        {"a": demand(0), "high": demand(0)},
        "a",
        0,
        30,
        # a has lower priority than high: it can only come back on release.
        Decision("high", "a", Reason.SWAPPED, None),
    ),
    (
        "higher-respects-own-window",
        GROUP,
        {"high": demand(28)},
        "a",
        0,
        30,
        Decision("a", None, Reason.WAITING, 33),
    ),
    (
        "undemanded-candidate-ignored",
        GROUP,
        {"b": MemberState(swapped_out_at=0)},
        "a",
        0,
        1000,
        Decision("a", None, Reason.KEPT, None),
    ),
    # --- several candidates
    (
        "pick-highest-priority",
        GROUP,
        {"b": demand(0), "high": demand(20)},
        "a",
        0,
        30,
        Decision("high", "a", Reason.SWAPPED, None),
    ),
    (
        "pick-earliest-demand",
        GROUP,
        {"c": demand(10), "b": demand(20)},
        "a",
        0,
        30,
        # b stays demanded and is eligible once c has run its 30 s.
        Decision("c", "a", Reason.SWAPPED, 60),
    ),
    (
        "pick-key-on-full-tie",
        GROUP,
        {"c": demand(10), "b": demand(10)},
        "a",
        0,
        30,
        Decision("b", "a", Reason.SWAPPED, 60),
    ),
    (
        "eligible-lower-rank-wins-over-ineligible-better",
        GROUP,
        {"b": demand(0), "high": demand(29)},
        "a",
        0,
        30,
        # high is the better candidate but still inside its window; b is eligible now. Once b holds
        # the group, high may take over after b's min run.
        Decision("b", "a", Reason.SWAPPED, 60),
    ),
    (
        "next-check-is-earliest-pending",
        GROUP,
        {"b": demand(40), "c": demand(0, swapped_out_at=0)},
        "a",
        0,
        44,
        Decision("a", None, Reason.WAITING, 45),
    ),
    # --- zero knobs and the same-instant guard
    (
        "zero-knobs-swap",
        (Member("x", 0, 0, 0, 0), Member("y", 0, 0, 0, 0)),
        {"x": demand(0), "y": demand(5)},
        "x",
        0,
        5,
        Decision("y", "x", Reason.SWAPPED, math.nextafter(5, math.inf)),
    ),
    # --- queue threshold (b needs 3 requests; window 5, a's min run 30)
    (
        "threshold-below-keeps-without-a-next-check",
        (A, Member("b", queue_threshold=3)),
        {"a": demand(0), "b": MemberState(demand_since=40, demand=2)},
        "a",
        0,
        100,
        Decision("a", None, Reason.KEPT, None),
    ),
    (
        "threshold-met-after-the-window-swaps",
        (A, Member("b", queue_threshold=3)),
        {"a": demand(0), "b": MemberState(demand_since=40, demand=3)},
        "a",
        0,
        100,
        Decision("b", "a", Reason.SWAPPED, 160),
    ),
    (
        "threshold-met-window-still-counts-from-demand-start",
        (A, Member("b", queue_threshold=3)),
        {"a": demand(0), "b": MemberState(demand_since=98, demand=5)},
        "a",
        0,
        100,
        Decision("a", None, Reason.WAITING, 103),
    ),
    (
        "threshold-met-min-run-still-holds",
        (A, Member("b", queue_threshold=3)),
        {"a": demand(0), "b": MemberState(demand_since=0, demand=3)},
        "a",
        10,
        20,
        Decision("a", None, Reason.WAITING, 40),
    ),
    (
        "threshold-does-not-apply-to-a-free-group",
        (A, Member("b", queue_threshold=3)),
        {"b": MemberState(demand_since=100, demand=1)},
        None,
        None,
        100,
        Decision("b", None, Reason.ACTIVATED, None),
    ),
    (
        "threshold-one-is-met-by-a-lease-alone",
        (A, Member("b", queue_threshold=1)),
        {"a": demand(0), "b": MemberState(demand_since=40, demand=0)},
        "a",
        0,
        100,
        Decision("b", "a", Reason.SWAPPED, 160),
    ),
    (
        "threshold-below-for-one-candidate-another-swaps",
        (A, Member("b", queue_threshold=3), C),
        {"a": demand(0), "b": MemberState(demand_since=10, demand=2), "c": MemberState(demand_since=50, demand=1)},
        "a",
        0,
        100,
        Decision("c", "a", Reason.SWAPPED, 160),
    ),
    (
        "zero-knobs-not-displaced-at-activation-instant",
        (Member("x", 0, 0, 0, 0), Member("y", 0, 0, 0, 0)),
        {"x": demand(0, swapped_out_at=5), "y": demand(5)},
        "y",
        5,
        5,
        Decision("y", None, Reason.WAITING, math.nextafter(5, math.inf)),
    ),
]


@pytest.mark.parametrize(
    ("members", "states", "active", "active_since", "now", "expected"),
    [pytest.param(*row[1:], id=row[0]) for row in TABLE],
)
def test_table(
    members: tuple[Member, ...],
    states: dict[str, MemberState],
    active: str | None,
    active_since: float | None,
    now: float,
    expected: Decision,
) -> None:
    assert arbitrate(members, states, active, active_since, now) == expected


def test_states_for_unknown_keys_are_ignored() -> None:
    assert arbitrate([A], {"ghost": demand(0)}, None, None, 10) == Decision(None, None, Reason.IDLE, None)


@pytest.mark.parametrize(
    ("members", "active", "active_since", "message"),
    [
        ((A, A), None, None, "duplicate"),
        ((A,), "b", 0.0, "not in the group"),
        ((A,), "a", None, "needs active_since"),
    ],
)
def test_bad_input(members: tuple[Member, ...], active: str | None, active_since: float | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        arbitrate(members, {}, active, active_since, 0)


@pytest.mark.parametrize("field", ["min_run_seconds", "swap_cooldown_seconds", "demand_window_seconds"])
@pytest.mark.parametrize("value", [-1.0, math.nan])
def test_member_rejects_bad_knobs(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        Member("a", **{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0, -3])
def test_member_rejects_a_queue_threshold_below_one(value: int) -> None:
    with pytest.raises(ValueError, match="queue_threshold"):
        Member("a", queue_threshold=value)


# --- simulator ---------------------------------------------------------------------------------


def test_simulate_swap_and_swap_back() -> None:
    # b is demanded from 10 on; a from the start; both keep demanding.
    events = simulate([A, B], [(0, "a", True), (10, "b", True)], step=1, until=200)
    assert events == [
        SwapEvent(0, "activate", "a", None),
        SwapEvent(30, "swap", "b", "a"),  # a's min run; b's window ended at 15
        SwapEvent(90, "swap", "a", "b"),  # a's cooldown (30 + 60); b ran its 30 s long ago
        SwapEvent(150, "swap", "b", "a"),
    ]


def test_simulate_release_and_priority() -> None:
    members = [A, HIGH]
    timeline = [(0, "a", True), (5, "high", True), (50, "high", False), (50, "a", True)]
    events = simulate(members, timeline, step=1, until=200, release_after=20)
    assert events == [
        SwapEvent(0, "activate", "a", None),
        SwapEvent(30, "swap", "high", "a"),
        SwapEvent(70, "release", None, "high"),  # idle from 50 for 20 s
        SwapEvent(70, "activate", "a", None),  # free group: a's cooldown does not apply
    ]


def test_simulate_accepts_a_function() -> None:
    events = simulate([A, B], lambda t: {"b"} if t >= 3 else set(), step=0.5, until=10)
    assert events == [SwapEvent(3, "activate", "b", None)]


def test_simulate_rejects_unknown_keys_and_bad_step() -> None:
    with pytest.raises(ValueError, match="not a group member"):
        simulate([A], [(0, "zz", True)], step=1, until=1)
    with pytest.raises(ValueError, match="not group members"):
        simulate([A], lambda t: {"zz"}, step=1, until=1)
    with pytest.raises(ValueError, match="step"):
        simulate([A], [], step=0, until=1)


# --- properties --------------------------------------------------------------------------------

KEYS = ("a", "b", "c", "d")
EPS = 1e-9

knob = st.integers(0, 60).map(float)
member_st = {
    key: st.builds(
        Member,
        key=st.just(key),
        priority=st.integers(-2, 2),
        min_run_seconds=knob,
        swap_cooldown_seconds=knob,
        demand_window_seconds=knob,
    )
    for key in KEYS
}
members_st = st.one_of(*(st.tuples(*(member_st[k] for k in KEYS[:n])) for n in (2, 3, 4)))


Situation = tuple[tuple[Member, ...], dict[str, MemberState], str | None, float | None, float]
ago = st.none() | st.integers(0, 90)


@st.composite
def situations(draw: st.DrawFn) -> Situation:
    """A group, its markers, its holder and a time; markers are drawn as seconds before now."""
    members = draw(members_st)
    now = 200.0

    def at(seconds_ago: int | None) -> float | None:
        return None if seconds_ago is None else now - seconds_ago

    states = {m.key: MemberState(at(draw(ago)), at(draw(ago))) for m in members}
    active = draw(st.none() | st.sampled_from([m.key for m in members]))
    active_since = None if active is None else at(draw(st.integers(0, 90)))
    return members, states, active, active_since, now


def eligible(member: Member, state: MemberState, holder: Member, since: float, now: float) -> bool:
    """The swap rule exactly as the docstring states it."""
    return (
        member.key != holder.key
        and member.priority >= holder.priority
        and state.demand_since is not None
        and now >= since + holder.min_run_seconds
        and now >= state.demand_since + member.demand_window_seconds
        and (state.swapped_out_at is None or now >= state.swapped_out_at + member.swap_cooldown_seconds)
        and now > since
    )


@settings(max_examples=150, deadline=None)
@given(situations())
def test_decision_follows_the_rules(
    situation: Situation,
) -> None:
    members, states, active, active_since, now = situation
    by_key = {m.key: m for m in members}
    d = arbitrate(members, states, active, active_since, now)
    demanded = {k for k, s in states.items() if s.demand_since is not None}

    # (a) one holder at most, and it is a member.
    assert d.active is None or d.active in by_key
    if active is None:
        assert d.swapped_out is None
        assert (d.active is None) == (not demanded)
    else:
        assert active_since is not None
        holder = by_key[active]
        candidates = [m for m in members if eligible(m, states[m.key], holder, active_since, now)]
        # Swaps exactly when some candidate qualifies, and only to a qualifying one.
        assert (d.active != active) == bool(candidates)
        if d.active != active:
            assert d.swapped_out == active
            assert by_key[d.active or ""] in candidates
            # (c) lower priority never takes over.
            assert by_key[d.active or ""].priority >= holder.priority
            assert max(m.priority for m in candidates) == by_key[d.active or ""].priority
        else:
            assert d.swapped_out is None


@settings(max_examples=150, deadline=None)
@given(situations())
def test_next_check_at_is_exact(
    situation: Situation,
) -> None:
    members, states, active, active_since, now = situation
    d = arbitrate(members, states, active, active_since, now)
    # The state the caller holds after applying the decision.
    if d.active != active:
        active_since = now
        if d.swapped_out is not None:
            old = states[d.swapped_out]
            states = {**states, d.swapped_out: MemberState(old.demand_since, swapped_out_at=now)}
        again = arbitrate(members, states, d.active, active_since, now)
        # Applying a decision and asking again at the same instant changes nothing.
        assert again.active == d.active
        assert again.next_check_at == d.next_check_at
    if d.next_check_at is None:
        assert arbitrate(members, states, d.active, active_since, now + 1e6).active == d.active
        return
    assert d.next_check_at > now
    # Nothing changes before next_check_at, and something does exactly then.
    before = math.nextafter(d.next_check_at, -math.inf)
    for t in {now, (now + d.next_check_at) / 2, before}:
        assert arbitrate(members, states, d.active, active_since, t).active == d.active
    assert arbitrate(members, states, d.active, active_since, d.next_check_at).active != d.active


@settings(max_examples=60, deadline=None)
@given(
    a=st.builds(
        Member,
        key=st.just("a"),
        priority=st.integers(0, 1),
        min_run_seconds=st.integers(1, 60).map(float),
        swap_cooldown_seconds=knob,
        demand_window_seconds=st.integers(0, 20).map(float),
    ),
    b=st.builds(
        Member,
        key=st.just("b"),
        priority=st.integers(0, 1),
        min_run_seconds=st.integers(1, 60).map(float),
        swap_cooldown_seconds=knob,
        demand_window_seconds=st.integers(0, 20).map(float),
    ),
    period=st.floats(0.5, 120, allow_nan=False),
    overlap=st.booleans(),
    release_after=st.one_of(st.none(), st.integers(0, 60).map(float)),
)
def test_no_thrashing_under_alternating_demand(
    a: Member, b: Member, period: float, overlap: bool, release_after: float | None
) -> None:
    horizon = 600.0

    def demanded(t: float) -> set[str]:
        # Demand flips between a and b every `period` seconds; with overlap, a is demanded throughout.
        turn = "a" if int(t // period) % 2 == 0 else "b"
        return {"a", turn} if overlap else {turn}

    events = simulate([a, b], demanded, step=0.5, until=horizon, release_after=release_after)
    by_key = {"a": a, "b": b}
    swaps = [e for e in events if e.kind == "swap"]
    # Swaps are bounded by the shortest min run.
    assert len(swaps) <= horizon / min(a.min_run_seconds, b.min_run_seconds) + 1
    holder_since: float | None = None
    swapped_out_at: dict[str, float] = {}
    for event in events:
        if event.kind == "swap":
            assert event.previous is not None and event.active is not None
            # The member swapped out had run its min run.
            assert holder_since is not None
            assert event.time - holder_since >= by_key[event.previous].min_run_seconds - EPS
            # A member swapped out never swaps back in within its cooldown.
            if event.active in swapped_out_at:
                cooldown = by_key[event.active].swap_cooldown_seconds
                assert event.time - swapped_out_at[event.active] >= cooldown - EPS
            swapped_out_at[event.previous] = event.time
        holder_since = None if event.kind == "release" else event.time


timelines = st.lists(st.tuples(st.integers(0, 300).map(float), st.sampled_from(KEYS), st.booleans()), max_size=30)


@settings(max_examples=60, deadline=None)
@given(
    members=members_st,
    timeline=timelines,
    step=st.sampled_from([0.5, 1.0, 2.5]),
    release_after=st.one_of(st.none(), st.integers(0, 60).map(float)),
)
def test_simulated_group_has_one_holder_and_no_preemption_by_lower_priority(
    members: tuple[Member, ...],
    timeline: list[tuple[float, str, bool]],
    step: float,
    release_after: float | None,
) -> None:
    keys = {m.key for m in members}
    timeline = [tr for tr in timeline if tr[1] in keys]
    events = simulate(members, timeline, step=step, until=400, release_after=release_after)
    by_key = {m.key: m for m in members}
    holder: str | None = None
    for event in events:
        # (a) at most one holder: every change starts from the one holder there is.
        assert event.previous == holder
        if event.kind == "activate":
            assert holder is None and event.active is not None
        elif event.kind == "swap":
            assert holder is not None and event.active is not None and event.active != holder
            # (c) never a lower priority over a higher one, demanded or not.
            assert by_key[event.active].priority >= by_key[holder].priority
        else:
            assert holder is not None and event.active is None
        holder = event.active
    times = [e.time for e in events]
    assert times == sorted(times)
