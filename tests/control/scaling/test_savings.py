"""The savings ledger: accelerator-seconds per tier integrate the tier's units over time, a window
cuts them at its ends, and wakes are counted by tier with their waiting."""

from __future__ import annotations

import pytest

from wakegate.control.scaling.savings import Ledger


def test_totals_and_windows_integrate_the_tiers() -> None:
    ledger = Ledger()
    ledger.observe("m", "zero", 2, 100.0)  # a 2-GPU replica's worth released
    ledger.observe("m", "warm", 2, 110.0)
    ledger.wake("m", "zero", 3.5, 110.0)
    ledger.observe("m", "asleep", 2, 130.0)
    ledger.observe("m", "warm", 2, 135.0)
    ledger.wake("m", "asleep", 0.25, 135.0)
    ledger.observe("m", "warm", 4, 140.0)  # a second replica
    ledger.observe("m", "zero", 2, 150.0)
    assert ledger.totals(160.0)["m"] == {"warm": 2 * 20 + 2 * 5 + 4 * 10, "asleep": 2 * 5, "zero": 2 * 10 + 2 * 10}
    window = ledger.window(120.0, 155.0)["m"]
    assert window["accelerator_seconds"] == {"warm": 2 * 10 + 2 * 5 + 4 * 10, "asleep": 10, "zero": 10}
    assert window["held"] == 70 and window["released"] == 20
    assert window["released_share"] == pytest.approx(20 / 90)
    assert window["wakes"] == {"asleep": {"count": 1, "wait_seconds": 0.25}, "zero": {"count": 0, "wait_seconds": 0.0}}
    # A repeated observation changes nothing; an unknown tier is refused.
    ledger.observe("m", "zero", 2, 158.0)
    assert ledger.totals(160.0)["m"]["zero"] == 40
    with pytest.raises(ValueError, match="unknown tier"):
        ledger.observe("m", "cold", 1, 161.0)
