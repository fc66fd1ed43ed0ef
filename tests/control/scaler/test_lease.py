"""The scaler's elector: it leads while it holds the Lease and gives it up when it stops."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest

from tests.support.fakekube import FakeApiServer
from wakegate.control.k8s.lease import LeaderLease, LeaseConfig
from wakegate.control.scaler.lease import LeaseElector


def test_a_stopping_leader_releases_the_lease_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    server = FakeApiServer()
    changes: list[bool] = []
    elector = LeaseElector(server.kube(), "ns", "scaler", "a", changes.append, lease_seconds=10, renew_seconds=0.05)
    stop = threading.Event()
    runner = threading.Thread(target=elector.run, args=(stop,))
    with caplog.at_level(logging.INFO, logger="wakegate.scaler.lease"):
        runner.start()
        try:
            assert _wait(lambda: changes == [True]), changes
        finally:
            stop.set()
            runner.join(10)
    assert changes == [True, False] and not elector.leader
    assert "lease ns/scaler: acquired" in caplog.text and "lease ns/scaler: released" in caplog.text
    assert "lost" not in caplog.text
    # Released: a standby takes it at once, without waiting out the 10 s lease.
    standby = LeaderLease(server.kube(), LeaseConfig("ns", "scaler", "b", 10, 2))
    assert standby.try_acquire_or_renew()


def _wait(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
