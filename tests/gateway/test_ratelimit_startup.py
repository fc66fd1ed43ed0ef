"""A limit holds from the first request `up` serves (docs/reliability.md). Each start is a fresh
`wakegate up`; right after it announces itself, 20 requests back to back meet a `burst: 2` model,
or a gateway-wide `--global-rps 2 --global-burst 2`.

Both buckets are Envoy's, whichever extproc a request reaches: the same across a failover to
the standby. (The gateway-wide one was each extproc's own, and before Envoy handed health-check
verdicts to its workers at once (`update_merge_window: 0s`) the first second after "serving
on" sent requests to the standby in about 5 starts in 8: each extproc admitted its own burst.)
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.support.faults import component_pid
from tests.support.http import request
from tests.support.up import UpProcess, model_doc

MODEL = "rl-start"
RATE, BURST = 2, 2
#: Fresh starts; WAKEGATE_RATELIMIT_STARTS=20 is the measurement in docs/reliability.md.
STARTS = int(os.environ.get("WAKEGATE_RATELIMIT_STARTS", "3"))
DOC = model_doc(
    MODEL,
    extra=f"""  scaling: {{min: 1, max: 1}}
  limits: {{requestsPerSecond: {RATE}, burst: {BURST}}}
""",
)
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("start", range(STARTS))
def test_exactly_the_burst_passes_right_after_serving_on(tmp_path: Path, start: int) -> None:
    up = UpProcess(tmp_path, DOC)
    try:
        up.wait_ready({MODEL: 1}, timeout=90)
        began = time.monotonic()
        codes = [request("POST", f"{up.base_url}/chat/completions", body=BODY).status for _ in range(20)]
        elapsed = time.monotonic() - began
    finally:
        assert up.stop() == 0, up.log()
    # Under 1 / RATE seconds in all, so the bucket refilled less than one token meanwhile.
    assert elapsed < 1 / RATE, f"20 requests took {elapsed:.2f}s: the refill could admit more"
    assert codes == [200] * BURST + [429] * (20 - BURST), codes


UNLIMITED = model_doc("plain", extra="  scaling: {min: 1, max: 1}\n")
SLOW_RATE = 0.2


@pytest.mark.parametrize("start", range(STARTS))
def test_exactly_the_global_burst_passes_right_after_serving_on(tmp_path: Path, start: int) -> None:
    # A slow refill (a token per 5 s): a loaded machine's slow requests cannot let more through.
    up = UpProcess(tmp_path, UNLIMITED, "--global-rps", str(SLOW_RATE), "--global-burst", str(BURST))
    body = {**BODY, "model": "plain"}
    try:
        up.wait_ready({"plain": 1}, timeout=90)
        began = time.monotonic()
        codes = [request("POST", f"{up.base_url}/chat/completions", body=body).status for _ in range(20)]
        elapsed = time.monotonic() - began
    finally:
        assert up.stop() == 0, up.log()
    assert elapsed < 1 / SLOW_RATE, f"20 requests took {elapsed:.2f}s: the refill could admit more"
    assert codes == [200] * BURST + [429] * (20 - BURST), codes


def test_the_global_bucket_is_one_across_a_failover(tmp_path: Path) -> None:
    """The active extproc dies right after the burst was spent: the standby's requests still find
    the bucket empty (an extproc's own bucket would have started full: 2 more passed)."""
    up = UpProcess(tmp_path, UNLIMITED, "--global-rps", str(SLOW_RATE), "--global-burst", str(BURST))
    body = {**BODY, "model": "plain"}
    try:
        up.wait_ready({"plain": 1}, timeout=90)
        began = time.monotonic()
        spent = [request("POST", f"{up.base_url}/chat/completions", body=body).status for _ in range(BURST)]
        os.kill(component_pid(up, "extproc-0"), signal.SIGKILL)
        after = [request("POST", f"{up.base_url}/chat/completions", body=body).status for _ in range(10)]
        elapsed = time.monotonic() - began
    finally:
        assert up.stop() == 0, up.log()
    assert elapsed < 1 / SLOW_RATE, f"{elapsed:.2f}s: a token may have come back meanwhile"
    assert spent == [200] * BURST and after == [429] * 10, (spent, after)
