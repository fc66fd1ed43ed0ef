"""Replica count for one model: a table per rule, then properties over random load traces."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wakegate.control.scaling.autoscale import Load, Policy, ScaleState, decide

ZERO = Policy(min=0, max=4)  # idle 300, target 8, out window 2, in window 30


def run(policy: Policy, state: ScaleState, steps: list[tuple[float, Load]]) -> list[int]:
    """Decide at each (time, load) in turn, carrying the state; the desired counts."""
    counts = []
    for now, load in steps:
        desired, state, _ = decide(policy, load, state, now)
        counts.append(desired)
    return counts


# --- wake ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("load", [Load(queued=1), Load(leases=1), Load(in_flight=1), Load(queued=100)], ids=repr)
def test_wake_is_immediate(load: Load) -> None:
    desired, state, _ = decide(ZERO, load, ScaleState(0), 50)
    assert desired == 1
    assert state.replicas == 1
    assert state.idle_since is None


def test_wake_then_scale_out_after_window() -> None:
    desired, state, next_check = decide(ZERO, Load(queued=20), ScaleState(0), 10)
    assert (desired, next_check) == (1, 12)  # 20 > 8 x 1: one more window to 3
    desired, state, next_check = decide(ZERO, Load(queued=20), state, 12)
    assert (desired, next_check) == (3, None)


def test_no_load_at_zero_stays_zero() -> None:
    assert decide(ZERO, Load(), ScaleState(0), 5) == (0, ScaleState(0, idle_since=5), None)


def test_zero_windows_wake_and_scale_out_in_one_decision() -> None:
    policy = Policy(min=0, max=10, scale_out_window=0)
    desired, state, next_check = decide(policy, Load(queued=30), ScaleState(0), 1)
    assert (desired, next_check) == (4, None)
    # Stable: the same call again changes nothing.
    assert decide(policy, Load(queued=30), state, 1) == (4, state, None)


# --- idle ----------------------------------------------------------------------------------------


def test_idle_to_zero_exactly_at_idle_timeout() -> None:
    desired, state, next_check = decide(ZERO, Load(), ScaleState(1), 100)
    assert (desired, state.idle_since, next_check) == (1, 100, 400)
    assert decide(ZERO, Load(), state, 399.999)[0] == 1
    assert decide(ZERO, Load(), state, 400)[:2] == (0, ScaleState(0, idle_since=100))


def test_idle_timer_restarts_after_load() -> None:
    counts = run(
        ZERO,
        ScaleState(1),
        [(0, Load()), (200, Load(in_flight=1)), (250, Load()), (500, Load()), (550, Load())],
    )
    assert counts == [1, 1, 1, 1, 0]


@pytest.mark.parametrize("load", [Load(in_flight=1), Load(queued=1), Load(leases=1)], ids=repr)
def test_load_keeps_it_alive(load: Load) -> None:
    desired, state, next_check = decide(ZERO, load, ScaleState(1), 0)
    assert (desired, state.idle_since, next_check) == (1, None, None)
    assert decide(ZERO, load, state, 10_000)[0] == 1


def test_idle_goes_to_min_not_zero() -> None:
    policy = Policy(min=2, max=6)
    desired, state, next_check = decide(policy, Load(), ScaleState(5), 0)
    assert (desired, next_check) == (5, 30)  # scale-in first: need 0 < 5
    desired, state, next_check = decide(policy, Load(), state, 30)
    assert (desired, next_check) == (2, None)  # max(min, 0, 1) = min: idle has nothing left to do


def test_scale_in_does_not_go_to_zero_idle_does() -> None:
    desired, state, next_check = decide(ZERO, Load(), ScaleState(3), 0)
    assert (desired, next_check) == (3, 30)
    desired, state, next_check = decide(ZERO, Load(), state, 30)
    assert (desired, next_check) == (1, 300)
    desired, state, next_check = decide(ZERO, Load(), state, 300)
    assert (desired, next_check) == (0, None)


# --- scale out -----------------------------------------------------------------------------------


def test_scale_out_after_window() -> None:
    desired, state, next_check = decide(ZERO, Load(queued=9, in_flight=8), ScaleState(1), 0)
    assert (desired, state.over_since, next_check) == (1, 0, 2)
    assert decide(ZERO, Load(queued=9, in_flight=8), state, 1.9)[0] == 1
    assert decide(ZERO, Load(queued=9, in_flight=8), state, 2)[0] == 3


def test_scale_out_needs_continuous_excess() -> None:
    heavy, light = Load(in_flight=17), Load(in_flight=5)
    counts = run(ZERO, ScaleState(1), [(0, heavy), (1, light), (2.5, heavy), (3, heavy), (4.5, heavy)])
    assert counts == [1, 1, 1, 1, 3]


def test_scale_out_at_exactly_target_is_not_over() -> None:
    desired, _, next_check = decide(ZERO, Load(in_flight=16), ScaleState(2), 0)
    assert (desired, next_check) == (2, None)


def test_scale_out_capped_at_max() -> None:
    desired, state, next_check = decide(ZERO, Load(queued=1000), ScaleState(1), 0)
    desired, state, next_check = decide(ZERO, Load(queued=1000), state, 2)
    assert (desired, next_check) == (4, None)


def test_each_scale_out_step_needs_its_own_window() -> None:
    policy = Policy(min=1, max=10)
    counts = run(
        policy,
        ScaleState(1),
        [(0, Load(in_flight=20)), (2, Load(in_flight=20)), (2.5, Load(in_flight=40)), (4, Load(in_flight=40))],
    )
    assert counts == [1, 3, 3, 3]
    assert decide(policy, Load(in_flight=40), decide(policy, Load(in_flight=40), ScaleState(3), 2.5)[1], 4.5)[0] == 5


# --- scale in ------------------------------------------------------------------------------------


def test_scale_in_after_window() -> None:
    load = Load(in_flight=10)  # need 2
    desired, state, next_check = decide(ZERO, load, ScaleState(4), 0)
    assert (desired, state.under_since, next_check) == (4, 0, 30)
    assert decide(ZERO, load, state, 29.9)[0] == 4
    desired, state, next_check = decide(ZERO, load, state, 30)
    assert (desired, state.under_since, next_check) == (2, None, None)


def test_scale_in_window_restarts_when_need_returns() -> None:
    counts = run(
        ZERO,
        ScaleState(4),
        [(0, Load(in_flight=10)), (20, Load(in_flight=30)), (25, Load(in_flight=10)), (50, Load(in_flight=10))],
    )
    assert counts == [4, 4, 4, 4]
    assert run(ZERO, ScaleState(4), [(25, Load(in_flight=10)), (55, Load(in_flight=10))]) == [4, 2]


def test_scale_in_never_below_in_flight_need() -> None:
    policy = Policy(min=0, max=8)
    _desired, state, _ = decide(policy, Load(in_flight=17), ScaleState(6), 0)
    assert decide(policy, Load(in_flight=17), state, 30)[0] == 3


def test_scale_in_respects_min() -> None:
    policy = Policy(min=3, max=8)
    desired, state, _ = decide(policy, Load(in_flight=1), ScaleState(6), 0)
    desired, state, next_check = decide(policy, Load(in_flight=1), state, 30)
    assert (desired, next_check) == (3, None)


# --- bounds and input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "replicas", "expected"),
    [(Policy(min=0, max=3), 5, 3), (Policy(min=2, max=3), 0, 2), (Policy(min=2, max=3), 1, 2)],
)
def test_out_of_bounds_count_is_clamped_at_once(policy: Policy, replicas: int, expected: int) -> None:
    assert decide(policy, Load(in_flight=1), ScaleState(replicas), 0)[0] == expected


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min": -1, "max": 1},
        {"min": 2, "max": 1},
        {"min": 0, "max": 0},
        {"min": 0, "max": 1, "target_in_flight": 0},
        {"min": 0, "max": 1, "idle_timeout": -1},
        {"min": 0, "max": 1, "scale_in_window": math.nan},
    ],
    ids=repr,
)
def test_policy_rejects_bad_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Policy(**kwargs)  # type: ignore[arg-type]


def test_load_and_state_reject_negatives() -> None:
    with pytest.raises(ValueError):
        Load(queued=-1)
    with pytest.raises(ValueError):
        ScaleState(-1)


# --- properties ----------------------------------------------------------------------------------


@st.composite
def policies(draw: st.DrawFn) -> Policy:
    low = draw(st.integers(0, 3))
    return Policy(
        min=low,
        max=draw(st.integers(max(low, 1), 8)),
        idle_timeout=draw(st.integers(0, 120).map(float)),
        target_in_flight=draw(st.integers(1, 10)),
        scale_out_window=draw(st.sampled_from([0.0, 0.5, 2.0, 5.0])),
        scale_in_window=draw(st.sampled_from([0.0, 1.0, 10.0, 30.0])),
    )


loads = st.builds(
    Load,
    queued=st.integers(0, 40) | st.just(0),
    in_flight=st.integers(0, 60) | st.just(0),
    leases=st.integers(0, 1),
)
# (gap before the load change, the load from then on)
traces = st.lists(st.tuples(st.integers(0, 40).map(lambda g: g / 2), loads), min_size=1, max_size=40)


def drive(policy: Policy, start: int, trace: list[tuple[float, Load]]) -> list[tuple[float, Load, int]]:
    """Feed a trace as a runtime would: decide on every load change and at every next_check_at."""
    state = ScaleState(start)
    out: list[tuple[float, Load, int]] = []
    now = 0.0
    load = Load()
    next_check: float | None = None
    for gap, new_load in [*trace, (1000.0, trace[-1][1])]:
        change_at = now + gap
        while next_check is not None and next_check < change_at:
            now = next_check
            desired, state, next_check = decide(policy, load, state, now)
            out.append((now, load, desired))
        now, load = change_at, new_load
        desired, state, next_check = decide(policy, load, state, now)
        out.append((now, load, desired))
    return out


@settings(max_examples=120, deadline=None)
@given(policy=policies(), start=st.integers(0, 8), trace=traces)
def test_trace_properties(policy: Policy, start: int, trace: list[tuple[float, Load]]) -> None:
    history = drive(policy, min(max(start, policy.min), policy.max), trace)
    last_change = history[0][0]  # the first decision starts every window
    idle_start: float | None = None
    previous = history[0][2]
    for now, load, desired in history:
        busy = load.queued + load.in_flight + load.leases > 0
        idle_start = None if busy else (now if idle_start is None else idle_start)
        # Bounds, and never zero while anything is waiting or running.
        assert policy.min <= desired <= policy.max
        if busy:
            assert desired >= 1
        if desired < previous:
            # Going down: never below what in-flight requests need (as far as max allows) ...
            assert desired >= min(policy.max, math.ceil(load.in_flight / policy.target_in_flight))
            # ... and either a full scale-in window after the previous change, or the drop to min after a
            # full idle timeout.
            idle_drop = idle_start is not None and desired == policy.min
            if not (idle_drop and idle_start is not None and now - idle_start >= policy.idle_timeout):
                assert now - last_change >= policy.scale_in_window
        if desired != previous:
            last_change = now
        previous = desired


@settings(max_examples=120, deadline=None)
@given(
    policy=policies(),
    load=loads,
    replicas=st.integers(0, 10),
    markers=st.tuples(*(st.none() | st.integers(0, 100).map(float) for _ in range(3))),
    now=st.integers(100, 200).map(float),
)
def test_single_decision_properties(
    policy: Policy,
    load: Load,
    replicas: int,
    markers: tuple[float | None, float | None, float | None],
    now: float,
) -> None:
    desired, state, next_check = decide(policy, load, ScaleState(replicas, *markers), now)
    assert policy.min <= desired <= policy.max
    assert state.replicas == desired
    if load.queued or load.in_flight or load.leases:
        assert desired >= 1
    # Stable: asking again at the same instant with the returned state changes nothing.
    assert decide(policy, load, state, now) == (desired, state, next_check)
    if next_check is None:
        assert decide(policy, load, state, now + 1e6)[0] == desired
    else:
        # Nothing changes before next_check_at, and the count does change exactly then.
        assert next_check > now
        assert decide(policy, load, state, math.nextafter(next_check, -math.inf))[0] == desired
        assert decide(policy, load, state, next_check)[0] != desired
