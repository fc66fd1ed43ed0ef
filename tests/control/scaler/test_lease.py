"""The scaler's elector: it leads while it holds the Lease and gives it up when it stops."""

from __future__ import annotations

import logging
import threading

import pytest

from tests.support.fakekube import FakeApiServer
from wakegate.control.k8s.lease import LeaderLease, LeaseConfig
from wakegate.control.scaler.lease import LeaseElector


def test_a_stopping_leader_releases_the_lease_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    server = FakeApiServer()
    changes: list[bool] = []
    acquired = threading.Event()

    def on_change(leader: bool) -> None:
        changes.append(leader)
        if leader:
            acquired.set()

    elector = LeaseElector(server.kube(), "ns", "scaler", "a", on_change, lease_seconds=10, renew_seconds=0.05)
    stop = threading.Event()
    runner = threading.Thread(target=elector.run, args=(stop,))
    with caplog.at_level(logging.INFO, logger="wakegate.scaler.lease"):
        runner.start()
        try:
            assert acquired.wait(10) and changes == [True], changes
        finally:
            stop.set()
            runner.join(10)
    assert changes == [True, False] and not elector.leader
    assert "lease ns/scaler: acquired" in caplog.text and "lease ns/scaler: released" in caplog.text
    assert "lost" not in caplog.text
    # Released: a standby takes it at once, without waiting out the 10 s lease.
    standby = LeaderLease(server.kube(), LeaseConfig("ns", "scaler", "b", 10, 2))
    assert standby.try_acquire_or_renew()

