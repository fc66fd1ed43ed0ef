"""Killing each gateway component while traffic runs: what a user keeps (real `wakegate up`, real kills).

Each test runs one scenario of tests/support/faults.py: streams on a running model, requests
held for a model loading from zero, a prober, then the fault. They assert behaviour with
generous timeouts; the timings of the same scenarios are tests/bench/bench_faults.py's, in
docs/reliability.md.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.faults import Record, run_scenario


def _recovered(record: Record) -> bool:
    return record.probes_after_fault > record.probes_failed and record.last_probes_ok


def test_extproc_death_loses_no_stream_and_fails_no_new_request(tmp_path: Path) -> None:
    record = run_scenario(tmp_path, "extproc")
    assert record.streams_kept == record.streams, record
    assert record.probes_failed == 0, record
    # Held by the extproc that died: the retriable 503 + Retry-After (docs/reliability.md).
    assert record.held_answered == record.held, record


def test_envoy_death_is_recovered(tmp_path: Path) -> None:
    record = run_scenario(tmp_path, "envoy")
    assert _recovered(record), record
    assert record.recovery_seconds < 30, record


def test_feeder_death_changes_nothing_for_traffic(tmp_path: Path) -> None:
    record = run_scenario(tmp_path, "feeder")
    assert record.streams_kept == record.streams, record
    # The cold model became ready while (or just after) the feeder was down: still served.
    assert record.held_ok == record.held, record
    assert record.probes_failed == 0, record


def test_backend_death_keeps_the_other_replica_serving(tmp_path: Path) -> None:
    record = run_scenario(tmp_path, "backend")
    assert record.held_ok == record.held, record
    assert _recovered(record), record
    assert record.restarted_backend, record


def test_sigterm_lets_a_10s_stream_finish_and_answers_held_requests(tmp_path: Path) -> None:
    record = run_scenario(tmp_path, "sigterm", stream_seconds=10.0)
    assert record.streams_kept == record.streams, record
    assert record.held_answered == record.held, record
    assert record.exit_code == 0, record
    # New connections are refused once the drain began (the listener is closed).
    assert record.probes_failed == record.probes_after_fault, record
