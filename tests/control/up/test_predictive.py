"""Predictive wake under `wakegate up` on a compressed day (periodSeconds 14): demand at the same
time of two days wakes the predictive model before the third day's first request, which finds it
warm, while its reactive twin, fed the same requests, is cold every time; status says why it woke;
the demand history survives a restart."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.support.http import request
from tests.support.up import UpProcess, model_doc

PERIOD = 14.0
#: The first request of each day comes this far into it.
PHASE = 2.0


def doc(name: str, predictive: bool) -> str:
    extra = "  args: [--startup-seconds, \"0.2\"]\n  scaling: {min: 0, max: 1, idleTimeout: 1, activationTimeout: 30"
    if predictive:
        extra += ", predictive: {enabled: true, leadSeconds: 4, periodSeconds: 14, budgetSeconds: 60}"
    return model_doc(name, extra=extra + "}\n")


def ask(up: UpProcess, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert request("POST", f"{up.base_url}/chat/completions", body=body, timeout=60).status == 200


def predictive_status(up: UpProcess, key: str) -> dict[str, Any]:
    return dict(next(m for m in up.status()["models"] if m["key"] == key)["predictive"])


def test_a_daily_pattern_is_woken_for_before_it_comes(tmp_path: Path) -> None:
    up = UpProcess(tmp_path, doc("p", True) + doc("r", False))
    try:
        up.wait_ready({}, timeout=60)
        start = time.time()  # the first day begins now (the prediction folds on the period, from any start)
        with ThreadPoolExecutor(2) as pool:
            for day in range(3):
                time.sleep(max(0.0, start + day * PERIOD + PHASE - time.time()))
                list(pool.map(lambda m: ask(up, m), ("p", "r")))
        p, r = predictive_status(up, "p"), predictive_status(up, "r")
        assert p["first_requests"] == {"found_warm": 1, "found_cold": 2}, p
        assert r["first_requests"] == {"found_warm": 0, "found_cold": 3}, r
        assert p["hits"] == 1 and p["misses"] == 0, p
        assert p["last_wake"]["outcome"] == "hit" and "daily" in p["last_wake"]["why"], p
        assert 0 < p["spent_seconds_this_period"] <= 60
        assert not r["enabled"] and "hits" not in r
    finally:
        assert up.stop() == 0, up.log()
    again = UpProcess(tmp_path, doc("p", True) + doc("r", False))
    try:
        again.wait_ready({}, timeout=60)
        assert predictive_status(again, "p")["history_onsets"] == 3
        assert predictive_status(again, "r")["history_onsets"] == 3
    finally:
        assert again.stop() == 0, again.log()
