"""Tests for wakegate.extproc.ratelimit: token buckets, global + per-model admission, Retry-After."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wakegate.extproc import ratelimit
from wakegate.extproc.ratelimit import RateLimiter, TokenBucket, retry_after_header


class FakeClock:
    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# --- TokenBucket -----------------------------------------------------------------------------


def test_bucket_burst_then_refusal() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=2.0, burst=5, clock=clock)
    assert [bucket.take() for _ in range(5)] == [0.0] * 5
    wait = bucket.take()
    assert wait == pytest.approx(0.5)
    # Refusal takes nothing: the answer doesn't grow.
    assert bucket.take() == pytest.approx(0.5)
    assert bucket.peek() == pytest.approx(0.5)


def test_bucket_refill_over_time() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=2.0, burst=2, clock=clock)
    assert bucket.take() == 0.0
    assert bucket.take() == 0.0
    assert bucket.take() == pytest.approx(0.5)
    clock.advance(0.25)
    assert bucket.take() == pytest.approx(0.25)
    clock.advance(0.25)
    assert bucket.take() == 0.0
    assert bucket.take() > 0
    # Long idle refills only up to burst.
    clock.advance(3600)
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, pytest.approx(0.5)]


def test_bucket_peek_does_not_take() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=1.0, burst=1, clock=clock)
    for _ in range(10):
        assert bucket.peek() == 0.0
    assert bucket.take() == 0.0
    assert bucket.peek() == pytest.approx(1.0)
    assert bucket.take() == pytest.approx(1.0)


def test_bucket_fractional_rate() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=0.1, burst=1, clock=clock)
    assert bucket.take() == 0.0
    assert bucket.take() == pytest.approx(10.0)
    clock.advance(9.0)
    assert bucket.take() == pytest.approx(1.0)
    clock.advance(1.0)
    assert bucket.take() == 0.0


def test_bucket_clock_going_backwards_grants_nothing() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=1.0, burst=1, clock=clock)
    assert bucket.take() == 0.0
    clock.advance(-10)
    assert bucket.take() > 0
    clock.advance(10.5)  # back to start + 0.5: only 0.5 s elapsed since the take
    assert bucket.take() == pytest.approx(0.5)


@pytest.mark.parametrize(("rate", "burst"), [(0, 1), (-1, 1), (math.nan, 1), (math.inf, 1), (1, 0.5), (1, math.nan)])
def test_bucket_rejects_nonsense(rate: float, burst: float) -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate, burst, clock=FakeClock())


# --- RateLimiter -----------------------------------------------------------------------------


def test_unlimited() -> None:
    clock = FakeClock()
    for global_rate in (None, 0, 0.0):
        limiter = RateLimiter(global_rate, None, clock=clock)
        for model_rate in (None, 0):
            assert all(limiter.admit("m", model_rate, None) == 0.0 for _ in range(10_000))
        assert limiter.model_bucket_count == 0


def test_model_only_burst_then_refusal_then_refill() -> None:
    clock = FakeClock()
    limiter = RateLimiter(None, None, clock=clock)
    assert [limiter.admit("m", 1.0, 3) for _ in range(3)] == [0.0] * 3
    assert limiter.admit("m", 1.0, 3) == pytest.approx(1.0)
    clock.advance(1.0)
    assert limiter.admit("m", 1.0, 3) == 0.0
    assert limiter.admit("m", 1.0, 3) == pytest.approx(1.0)
    # Another model has its own bucket.
    assert limiter.admit("other", 1.0, 3) == 0.0


def test_burst_defaults_to_max_one_rate() -> None:
    clock = FakeClock()
    limiter = RateLimiter(None, None, clock=clock)
    assert sum(limiter.admit("fast", 5.0, None) == 0.0 for _ in range(20)) == 5
    assert sum(limiter.admit("slow", 0.2, None) == 0.0 for _ in range(20)) == 1
    assert limiter.admit("slow", 0.2, None) == pytest.approx(5.0)
    glob = RateLimiter(3.0, None, clock=clock)
    assert sum(glob.admit("x", None, None) == 0.0 for _ in range(20)) == 3


def test_model_refusal_does_not_consume_global() -> None:
    clock = FakeClock()
    limiter = RateLimiter(global_rate=1.0, global_burst=5, clock=clock)
    assert limiter.admit("a", 1.0, 1) == 0.0  # global 4 left
    for _ in range(50):
        assert limiter.admit("a", 1.0, 1) > 0  # refused by the model bucket only
    # The global bucket still has 4 tokens for other models.
    assert [limiter.admit("b", None, None) for _ in range(4)] == [0.0] * 4
    assert limiter.admit("b", None, None) > 0


def test_global_refusal_does_not_consume_model() -> None:
    clock = FakeClock()
    limiter = RateLimiter(global_rate=1.0, global_burst=2, clock=clock)
    assert limiter.admit("other", None, None) == 0.0
    assert limiter.admit("other", None, None) == 0.0  # global now empty
    for _ in range(50):
        assert limiter.admit("a", 0.1, 3) == pytest.approx(1.0)  # refused by global only
    clock.advance(2.0)  # global refills to 2; model "a" (slow refill) must still hold its 3
    assert limiter.admit("a", 0.1, 3) == 0.0
    assert limiter.admit("a", 0.1, 3) == 0.0
    assert limiter.admit("a", 0.1, 3) == pytest.approx(1.0)  # global empty again
    clock.advance(1.0)
    assert limiter.admit("a", 0.1, 3) == 0.0  # the model's third token was still there


def test_retry_after_is_the_longer_wait() -> None:
    clock = FakeClock()
    limiter = RateLimiter(global_rate=0.5, global_burst=1, clock=clock)
    assert limiter.admit("a", 0.25, 1) == 0.0
    # Model needs 4 s, global 2 s: wait for both.
    assert limiter.admit("a", 0.25, 1) == pytest.approx(4.0)
    assert limiter.admit("b", None, None) == pytest.approx(2.0)
    clock.advance(4.0)
    assert limiter.admit("a", 0.25, 1) == 0.0


def test_rate_change_replaces_bucket() -> None:
    clock = FakeClock()
    limiter = RateLimiter(None, None, clock=clock)
    assert limiter.admit("m", 1.0, 1) == 0.0
    assert limiter.admit("m", 1.0, 1) > 0
    # New (rate, burst): a fresh, full bucket with the new parameters.
    assert [limiter.admit("m", 2.0, 3) for _ in range(3)] == [0.0] * 3
    assert limiter.admit("m", 2.0, 3) == pytest.approx(0.5)
    # Burst-only change also replaces.
    assert limiter.admit("m", 2.0, 4) == 0.0
    assert limiter.model_bucket_count == 1
    # Becoming unlimited drops the bucket.
    assert all(limiter.admit("m", None, None) == 0.0 for _ in range(10))
    assert limiter.model_bucket_count == 0


def test_same_params_keep_bucket() -> None:
    clock = FakeClock()
    limiter = RateLimiter(None, None, clock=clock)
    assert limiter.admit("m", 1.0, None) == 0.0
    assert limiter.admit("m", 1.0, 1) > 0  # None burst == max(1, rate) == 1: same bucket


def test_model_buckets_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ratelimit, "MAX_MODEL_BUCKETS", 100)
    clock = FakeClock()
    limiter = RateLimiter(None, None, clock=clock)
    for i in range(1000):
        limiter.admit(f"model-{i}", 1.0, 2)
        limiter.admit(f"model-{i}", 1.0, 2)  # leave each bucket busy (not full)
    assert limiter.model_bucket_count == 100


def test_idle_buckets_are_dropped() -> None:
    clock = FakeClock()
    limiter = RateLimiter(None, None, clock=clock)
    for i in range(500):
        limiter.admit(f"model-{i}", 1.0, 2)
    assert limiter.model_bucket_count == 500
    clock.advance(1.0)  # every bucket refilled to full: indistinguishable from a new one
    limiter.admit("new", 1.0, 2)
    assert limiter.model_bucket_count == 1


def test_busy_model_keeps_state_across_pruning() -> None:
    clock = FakeClock()
    limiter = RateLimiter(None, None, clock=clock)
    assert limiter.admit("busy", 0.01, 1) == 0.0
    for i in range(100):
        clock.advance(0.1)
        limiter.admit(f"m{i}", 100.0, 1)
    assert limiter.admit("busy", 0.01, 1) > 0  # not reset by pruning


@pytest.mark.parametrize(("rate", "burst"), [(-1.0, None), (math.nan, None), (math.inf, None), (1.0, 0.5)])
def test_limiter_rejects_nonsense(rate: float, burst: float | None) -> None:
    with pytest.raises(ValueError):
        RateLimiter(rate, burst, clock=FakeClock())
    with pytest.raises(ValueError):
        RateLimiter(None, None, clock=FakeClock()).admit("m", rate, burst)


# --- Retry-After -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "header"),
    [
        (0.0, "1"),
        (0.001, "1"),
        (0.5, "1"),
        (1.0, "1"),
        (1.0001, "2"),
        (1.5, "2"),
        (2.0, "2"),
        (59.2, "60"),
        (3600.0, "3600"),
        (-3.0, "1"),
        (math.nan, "1"),
    ],
)
def test_retry_after_header(seconds: float, header: str) -> None:
    assert retry_after_header(seconds) == header


def test_retry_after_from_limiter() -> None:
    clock = FakeClock()
    limiter = RateLimiter(None, None, clock=clock)
    limiter.admit("m", 0.4, 1)
    assert retry_after_header(limiter.admit("m", 0.4, 1)) == "3"  # 2.5 s -> 3


# --- Property: never more than burst + rate * elapsed ------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    model_rate=st.floats(min_value=0.05, max_value=50.0),
    model_burst=st.one_of(st.none(), st.floats(min_value=1.0, max_value=20.0)),
    global_rate=st.one_of(st.none(), st.floats(min_value=0.05, max_value=50.0)),
    global_burst=st.one_of(st.none(), st.floats(min_value=1.0, max_value=20.0)),
    steps=st.lists(
        st.tuples(st.floats(min_value=0.0, max_value=2.0), st.integers(min_value=0, max_value=8)),
        min_size=1,
        max_size=150,
    ),
)
def test_admitted_never_exceeds_burst_plus_rate_times_elapsed(
    model_rate: float,
    model_burst: float | None,
    global_rate: float | None,
    global_burst: float | None,
    steps: list[tuple[float, int]],
) -> None:
    clock = FakeClock(start=0.0)
    limiter = RateLimiter(global_rate, global_burst, clock=clock)
    eff_model_burst = model_burst if model_burst is not None else max(1.0, model_rate)
    bounds = [(model_rate, eff_model_burst)]
    if global_rate is not None:
        bounds.append((global_rate, global_burst if global_burst is not None else max(1.0, global_rate)))
    times: list[float] = []  # time of each step
    counts: list[int] = []  # admissions in each step
    for dt, attempts in steps:
        clock.advance(dt)
        admitted = 0
        for _ in range(attempts):
            wait = limiter.admit("m", model_rate, model_burst)
            assert wait >= 0.0
            if wait == 0.0:
                admitted += 1
            else:
                # A refusal's Retry-After is honest: no longer than refilling one token takes.
                assert wait <= max(1.0 / r for r, _ in bounds) + 1e-9
        times.append(clock.now)
        counts.append(admitted)
    # In every window [t_i, t_j] (not just from the start), at most burst + rate * (t_j - t_i).
    for i in range(len(times)):
        in_window = 0
        for j in range(i, len(times)):
            in_window += counts[j]
            for rate, burst in bounds:
                assert in_window <= burst + rate * (times[j] - times[i]) + 1e-6


@settings(max_examples=30, deadline=None)
@given(
    rate=st.floats(min_value=0.1, max_value=20.0),
    burst=st.floats(min_value=1.0, max_value=10.0),
    gaps=st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=1, max_size=100),
)
def test_waiting_retry_after_then_admitted(rate: float, burst: float, gaps: list[float]) -> None:
    clock = FakeClock(start=0.0)
    bucket = TokenBucket(rate, burst, clock=clock)
    for gap in gaps:
        clock.advance(gap)
        wait = bucket.take()
        if wait > 0:
            clock.advance(wait * (1 + 1e-9) + 1e-12)
            assert bucket.take() == 0.0
