"""Idle tiers under `wakegate up` with the sim's implementation of vLLM's sleep API: a model idles
warm -> asleep (process alive, engine asleep, unrouted) -> zero; a request to a sleeping model is
held like a cold one and answered once the engine woke, without a new process; /status, /savings
and /metrics show the tier, the wakes by tier and the accelerator-seconds held and released."""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.support.http import request
from tests.support.up import UpProcess, model_doc
from tests.support.waiting import wait_for


def chat(up: UpProcess, model: str) -> int:
    response = request(
        "POST",
        f"{up.base_url}/chat/completions",
        body={"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2},
        timeout=60,
    )
    return response.status


def model_status(up: UpProcess, key: str) -> dict[str, Any]:
    return next(m for m in up.status()["models"] if m["key"] == key)


def is_sleeping(port: int) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/is_sleeping", timeout=5) as response:
        return bool(json.loads(response.read())["is_sleeping"])


def test_warm_asleep_zero_and_the_wake_in_between(tmp_path: Path) -> None:
    doc = model_doc(
        "m",
        extra="""  args: [--startup-seconds, "1", --wake-seconds, "0.1"]
  scaling: {min: 0, max: 1, sleepAfter: 1, idleTimeout: 6, activationTimeout: 30}
""",
    )
    up = UpProcess(tmp_path, doc)
    try:
        up.wait_ready({}, timeout=60)
        assert chat(up, "m") == 200
        replica = model_status(up, "m")["replicas"][0]
        wait_for(lambda: model_status(up, "m")["tier"] == "asleep", 30.0, "asleep")
        status = model_status(up, "m")
        assert status["ready"] == 0 and status["state"] == "asleep"
        assert status["replicas"][0]["pid"] == replica["pid"] and is_sleeping(replica["port"])

        # Held like a cold request, answered by the same process once it woke.
        assert chat(up, "m") == 200
        status = model_status(up, "m")
        assert status["tier"] == "warm" and status["replicas"][0]["pid"] == replica["pid"]
        assert not is_sleeping(replica["port"])
        assert status["last_wake_seconds"]["asleep"] is not None
        wakes = up.status()["savings"]["models"]["m"]["wakes"]
        assert wakes["asleep"]["count"] == 1 and wakes["zero"]["count"] == 1

        # Asleep again, then zero once idleTimeout passed: no process left.
        wait_for(lambda: model_status(up, "m")["tier"] == "zero", 30, "zero")
        assert model_status(up, "m")["replicas"] == []
        savings = up.status()["savings"]["models"]["m"]["accelerator_seconds"]
        assert savings["warm"] > 0 and savings["asleep"] > 0 and savings["zero"] > 0
        metrics = request("GET", f"http://127.0.0.1:{up.admin_port}/metrics").body.decode()
        assert 'wakegate_model_tier{model="m",tier="zero"} 1.0' in metrics
        assert 'wakegate_wake_seconds_count{model="m",tier="asleep"} 1.0' in metrics
    finally:
        assert up.stop() == 0, up.log()


def test_a_sleeping_engine_that_dies_is_started_anew(tmp_path: Path) -> None:
    doc = model_doc(
        "m",
        extra="""  args: [--wake-seconds, "0.05"]
  scaling: {min: 0, max: 1, sleepAfter: 1, idleTimeout: 60, activationTimeout: 30}
""",
    )
    up = UpProcess(tmp_path, doc)
    try:
        up.wait_ready({}, timeout=60)
        assert chat(up, "m") == 200
        wait_for(lambda: model_status(up, "m")["tier"] == "asleep", 30.0, "asleep")
        pid = model_status(up, "m")["replicas"][0]["pid"]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: model_status(up, "m")["tier"] == "zero", 30.0, "zero")
        assert chat(up, "m") == 200  # held, and answered by a new process
        (replica,) = model_status(up, "m")["replicas"]
        assert replica["pid"] != pid and model_status(up, "m")["tier"] == "warm"
    finally:
        assert up.stop() == 0, up.log()


def test_a_request_during_the_idle_release_is_a_booked_wake(tmp_path: Path) -> None:
    """Demand that comes while the last replica is still being stopped (it is unrouted, then
    drained, then signalled: ~0.5 s) wakes the model again; that wake from zero is booked and timed
    like any other, not started silently by the stopping task."""
    doc = model_doc("m", extra="  scaling: {min: 0, max: 1, idleTimeout: 1, activationTimeout: 30}\n")
    up = UpProcess(tmp_path, doc)

    def wakes() -> int:
        return int(up.status()["savings"]["models"]["m"]["wakes"]["zero"]["count"])

    try:
        up.wait_ready({}, timeout=60)
        for _ in range(3):
            assert chat(up, "m") == 200  # a warm replica (a wake from zero)
            first, before = model_status(up, "m")["replicas"][0]["pid"], wakes()
            wait_for(lambda: model_status(up, "m")["replicas"] == [], 30, "the idle release")
            assert chat(up, "m") == 200  # held while the release finishes, then served by a new process
            if wakes() == before + 1:
                break
            # Answered by the replica being released, its unrouting not at the gateway yet (a few
            # ms): no wake was needed. Wait for the release to end and try again from warm.
            wait_for(lambda: model_status(up, "m")["tier"] == "zero", 30.0, "zero")
        else:
            pytest.fail("three requests during an idle release were all answered by the released replica")
        (replica,) = model_status(up, "m")["replicas"]
        assert replica["pid"] != first
        metrics = request("GET", f"http://127.0.0.1:{up.admin_port}/metrics").body.decode()
        assert f'wakegate_cold_start_seconds_count{{model="m",stage="total"}} {float(wakes())}' in metrics
    finally:
        assert up.stop() == 0, up.log()
