"""Known HTTP/2 floods against extproc's server inside a real gateway (`wakegate up`: Envoy,
extproc, a sim), while a prober sends requests through the gateway.

Each attack (tests/support/h2attack.py) goes straight to extproc's HTTP/2 port, as a local
process could. What must hold: the server ends the attacking connection with GOAWAY
ENHANCE_YOUR_CALM long before the attack has sent everything, and the prober's requests
keep being answered, none failed, none stalled. The bounds here are generous (this machine
is shared); the latencies themselves are measured by tests/bench/bench_h2_floods.py.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.support import h2attack
from tests.support.up import UpProcess, model_doc
from wakegate import contract

MODEL = "flood-probe"
BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
#: A prober request slower than this during an attack would mean the gateway stalled.
STALL_SECONDS = 5.0


@dataclass
class Prober:
    """Sends requests through the gateway one after another on one keep-alive connection."""

    port: int
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Prober:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(30)

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        while not self._stop.is_set():
            start = time.perf_counter()
            try:
                conn.request("POST", "/v1/chat/completions", BODY, {"content-type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                if resp.status != 200:
                    self.failures.append(f"status {resp.status}")
            except (OSError, http.client.HTTPException) as exc:
                self.failures.append(repr(exc))
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            self.latencies.append(time.perf_counter() - start)
            time.sleep(0.005)
        conn.close()


def extproc_port(up: UpProcess) -> int:
    """extproc's HTTP/2 port, read from the Envoy bootstrap `up` rendered."""
    config = yaml.safe_load((up.state_dir / "envoy.yaml").read_text())
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == contract.EXTPROC_CLUSTER:
            endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
            return int(endpoint["address"]["socket_address"]["port_value"])
    raise AssertionError("no extproc cluster in the bootstrap")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[UpProcess, int]]:
    tmp: Path = tmp_path_factory.mktemp("floods")
    limits = ["preface_timeout=1", "idle_timeout=1"]
    up = UpProcess(tmp, model_doc(MODEL, extra="  scaling: {min: 1, max: 1}\n"),
                   *(arg for limit in limits for arg in ("--extproc-h2-limit", limit)))  # fmt: skip
    try:
        up.wait_ready({MODEL: 1}, timeout=90)
        yield up, extproc_port(up)
    finally:
        assert up.stop() == 0, up.log()


@pytest.mark.parametrize("attack", h2attack.attacks(), ids=lambda a: a.name.replace(" ", "-"))
def test_flood_ends_the_connection_and_the_gateway_keeps_serving(gateway, attack: h2attack.Flood) -> None:
    up, port = gateway
    size = h2attack.SIZES[attack.name]
    with Prober(up.port) as prober:
        time.sleep(0.2)
        served_before = len(prober.latencies)
        outcome = h2attack.flood("127.0.0.1", port, attack, size, seconds=60, reconnect=False)
        time.sleep(0.3)
    assert outcome.ended == [h2attack.ENHANCE_YOUR_CALM], outcome
    assert outcome.frames < size, f"the server took the whole attack: {outcome}"
    assert not prober.failures, prober.failures
    assert len(prober.latencies) > served_before, "the prober was not served during the attack"
    assert max(prober.latencies) < STALL_SECONDS, sorted(prober.latencies)[-5:]


def test_silent_and_half_open_connections_are_closed(gateway) -> None:
    up, port = gateway
    with Prober(up.port) as prober:
        silent = h2attack.idle_connections("127.0.0.1", port, 50, preface=False)
        quiet = h2attack.idle_connections("127.0.0.1", port, 50, preface=True)
        try:
            # preface_timeout=1 closes the silent ones; idle_timeout=1 sends the quiet ones a
            # GOAWAY and a PING they never answer, and closes them a period later.
            assert all(h2attack.closed_by_server(s, 15) for s in silent)
            assert all(h2attack.closed_by_server(s, 15) for s in quiet)
        finally:
            for sock in silent + quiet:
                sock.close()
    assert not prober.failures, prober.failures
    assert prober.latencies and max(prober.latencies) < STALL_SECONDS
