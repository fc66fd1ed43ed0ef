"""Predictive wake's pure part: daily/weekly periodicity and regular inter-arrival times predict the
next onset (with a reason), irregular or thin history predicts nothing, the budget stops spending,
and the history survives a round trip through its file format."""

from __future__ import annotations

import pytest

from wakegate.control.scaling.predict import History, Policy, Speculation, predict

DAY = Policy(lead=5, budget=30, period=100)


def test_the_same_time_on_past_days_predicts_it_again() -> None:
    onsets = [10.0, 110.5, 209.0]
    found = predict(onsets, 301.0, DAY)
    assert found is not None and found.source == "daily" and 308 <= found.at <= 311
    assert "on 3 of the last 3 days" in found.why
    # Too far ahead of the prediction to act: nothing yet.
    assert predict(onsets, 280.0, DAY) is None
    # One past day is not a pattern.
    assert predict([209.0], 301.0, DAY) is None
    # Demand that came for the predicted time served it: not predicted again.
    assert predict([*onsets, 309.5], 309.6, DAY) is None


def test_a_missed_day_weakens_but_does_not_erase_the_pattern() -> None:
    # Days 0, 1 and 3 had demand at ~10 s; day 2 did not: 3 of the last 4 still predict day 4.
    found = predict([10.0, 110.0, 310.0], 405.0, DAY)
    assert found is not None and "3 of the last 4 days" in found.why
    # Only 1 of the last 4 days: not predicted.
    assert predict([10.0, 340.0, 370.0], 405.0, DAY) is None


def test_weekly_periodicity_predicts_what_the_days_do_not() -> None:
    week = 700.0
    onsets = [50.0, 50.0 + week, 50.0 + 2 * week]
    found = predict(onsets, 50.0 + 3 * week - 3, DAY)
    assert found is not None and found.source == "weekly" and "weeks" in found.why


def test_regular_inter_arrival_times_predict_the_next_onset() -> None:
    policy = Policy(lead=2, budget=30, period=86400)
    onsets = [0.0, 10.0, 20.5, 30.0, 40.0]
    found = predict(onsets, 45.0, policy)
    assert found is not None and found.source == "interarrival" and found.at == pytest.approx(50.0)
    assert "gaps were 10-10s" in found.why
    assert predict([0.0, 3.0, 20.0, 22.0, 40.0], 45.0, policy) is None  # irregular


def test_the_budget_and_the_outcomes() -> None:
    speculation = Speculation(DAY)
    found = predict([10.0, 110.0, 210.0], 301.0, DAY)
    assert found is not None
    episode = speculation.woke(found, 303.0)
    episode.spent = 12.0
    assert speculation.settle("hit") is episode and speculation.hits == 1
    episode = speculation.woke(found, 320.0)
    episode.spent = 20.0
    speculation.settle("miss")
    assert speculation.misses == 1 and speculation.wasted == 20.0 and speculation.spent_total == 32.0
    assert speculation.spent(330.0) == 32.0 and not speculation.affordable(330.0)
    assert speculation.affordable(430.0)  # a period later the budget is fresh
    status = speculation.status(330.0)
    assert status["last_wake"]["outcome"] == "miss" and status["last_wake"]["why"] == found.why


def test_history_round_trips_and_refuses_other_files() -> None:
    history = History()
    history.add("m", 2.0)
    history.add("m", 1.0)
    back = History.from_json(history.to_json())
    assert back.of("m") == [1.0, 2.0]
    with pytest.raises(ValueError, match="demand history"):
        History.from_json('{"version": 2}')
