"""Fault scenarios against a real `wakegate up`: kill a component while traffic runs, record what survives.

One scenario starts `wakegate up` with two sim models: `hot` (two replicas, always running,
20 tokens/s) and `cold` (scale from zero, a few seconds to load). It then starts, at once:

* `streams` streaming chat completions on `hot`, each several seconds long;
* `held` requests to `cold`, which the gateway holds while the model loads;
* a prober: one small request to `hot` after another, for the whole scenario;

and, a moment later, the fault. It waits for all of it to end and returns a `Record`:
streams kept (finished with `[DONE]`), held requests answered (a 200, or the retriable 503 +
Retry-After the docs name), probes failed after the fault, the time from the fault to
the end of the last failed probe (recovery), how much longer than the cold start the held
requests waited, and every ERROR or traceback the gateway's Python processes logged. Used by
tests/reliability (behaviour, with generous timeouts) and tests/bench/bench_faults.py (the
numbers in docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.http import get_json
from tests.support.up import UpProcess, model_doc

TOKENS_PER_SECOND = 20
MODELS = model_doc(
    "hot", extra=f'  scaling: {{min: 2, max: 2}}\n  args: ["--tokens-per-second", "{TOKENS_PER_SECOND}"]\n'
) + model_doc(
    "cold",
    extra='  scaling: {min: 0, max: 1, idleTimeout: 300}\n  args: ["--startup-seconds", "4"]\n',
)


@dataclass
class Record:
    fault: str
    streams: int
    streams_kept: int
    held: int
    held_ok: int
    held_retriable: int
    probes_after_fault: int = 0
    probes_failed: int = 0
    recovery_seconds: float = 0.0
    slowest_probe_seconds: float = 0.0
    #: The last probes (after everything else ended) all succeeded.
    last_probes_ok: bool = False
    #: Backend fault: the killed replica was running again at the end.
    restarted_backend: bool = False
    exit_code: int | None = None
    #: The longest a held request waited beyond the cold model's start (`up`'s measure of it).
    held_beyond_start_seconds: float = 0.0
    #: Probes after the fault that got a 200 although one started before them had failed.
    served_after_a_failure: int = 0
    #: ERROR lines and tracebacks in the logs of `up`, the feeder and the extprocs.
    log_errors: list[str] = field(default_factory=list)
    #: What each held request got: its status (0: no answer, with the error) and Retry-After.
    held_outcomes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def held_answered(self) -> int:
        return self.held_ok + self.held_retriable


def _post(port: int, body: dict[str, object], timeout: float) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def _chat(model: str, max_tokens: int, *, stream: bool = False) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": max_tokens, "stream": stream}


class Traffic:
    """Streams, held requests and a prober against one gateway port."""

    def __init__(self, port: int, *, streams: int, stream_seconds: float, held: int) -> None:
        self.port = port
        self.stream_results: list[bool] = []
        self.held_results: list[tuple[int, str]] = []
        #: When the held requests were sent, and when each got its answer.
        self.held_sent = 0.0
        self.held_done: list[float] = []
        self.probes: list[tuple[float, float, bool, str]] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._stream, args=(int(stream_seconds * TOKENS_PER_SECOND),), daemon=True)
            for _ in range(streams)
        ]
        self._threads += [threading.Thread(target=self._held, daemon=True) for _ in range(held)]
        self._prober = threading.Thread(target=self._probe, daemon=True)
        self._lock = threading.Lock()

    def start(self) -> None:
        self.held_sent = time.monotonic()
        for thread in self._threads:
            thread.start()
        self._prober.start()

    def _stream(self, tokens: int) -> None:
        try:
            status, _, body = _post(self.port, _chat("hot", tokens, stream=True), timeout=120)
            ok = status == 200 and body.rstrip().endswith(b"data: [DONE]")
        except (OSError, http.client.HTTPException):
            ok = False
        with self._lock:
            self.stream_results.append(ok)

    def _held(self) -> None:
        try:
            status, headers, _ = _post(self.port, _chat("cold", 1), timeout=120)
            outcome = (status, headers.get("retry-after", ""))
        except (OSError, http.client.HTTPException) as exc:
            outcome = (0, type(exc).__name__)
        with self._lock:
            self.held_results.append(outcome)
            self.held_done.append(time.monotonic())

    def _probe(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                status, _, body = _post(self.port, _chat("hot", 1), timeout=30)
                ok, what = status == 200, f"{status} {body[:120]!r}"
            except (OSError, http.client.HTTPException) as exc:
                ok, what = False, type(exc).__name__
            self.probes.append((started, time.monotonic(), ok, what))
            time.sleep(0.05)

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()
        self._prober.join(35)


def component_pid(up: UpProcess, name: str) -> int:
    pid = up.status()["components"][name]["pid"]
    assert isinstance(pid, int)
    return pid


def backend_pid(up: UpProcess, model: str) -> int:
    for entry in up.status()["models"]:
        if entry["key"] == model:
            return int(entry["replicas"][0]["pid"])
    raise KeyError(model)


#: How long the `extproc-stall` fault stops the active extproc (SIGSTOP, then SIGCONT).
STALL_SECONDS = 5.0


EXTPROCS = ("extproc-0", "extproc-1")


def holding_extproc(up: UpProcess, timeout: float = 5.0) -> str:
    """The extproc holding requests for `cold` (Envoy sends traffic to one at a time: the active one,
    normally the first; the standby while a health check of the first failed)."""
    deadline = time.monotonic() + timeout
    while True:
        for name in EXTPROCS:
            port = up.child_arg(name, "--admin-listen").rsplit(":", 1)[1]
            with contextlib.suppress(OSError, ValueError):
                view = get_json(f"http://127.0.0.1:{port}/wakegate/queue")
                if any(m["model"] == "cold" and m["queued"] for m in view["models"]):
                    return name
        if time.monotonic() > deadline:
            return EXTPROCS[0]
        time.sleep(0.05)


def _kill_holder(up: UpProcess) -> None:
    os.kill(component_pid(up, holding_extproc(up)), signal.SIGKILL)


def _kill_both_extprocs(up: UpProcess) -> None:
    """The extproc holding the cold requests, then 0.5 s later the other (which by then holds them)."""
    first = holding_extproc(up)
    pids = [component_pid(up, first), component_pid(up, next(n for n in EXTPROCS if n != first))]
    os.kill(pids[0], signal.SIGKILL)
    time.sleep(0.5)
    os.kill(pids[1], signal.SIGKILL)


def _stall_extproc(up: UpProcess) -> None:
    """Stop the extproc holding the cold requests for STALL_SECONDS: alive to the kernel (its
    connections stay open and new ones are accepted), silent."""
    pid = component_pid(up, holding_extproc(up))
    os.kill(pid, signal.SIGSTOP)
    resume = threading.Timer(STALL_SECONDS, _resume, args=(pid,))
    resume.daemon = True
    resume.start()


def _resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


#: Fault name -> what to do to the running `up`.
FAULTS: dict[str, Callable[[UpProcess], None]] = {
    "extproc": _kill_holder,
    "extproc-both": _kill_both_extprocs,
    "extproc-stall": _stall_extproc,
    "envoy": lambda up: os.kill(component_pid(up, "envoy"), signal.SIGKILL),
    "feeder": lambda up: os.kill(component_pid(up, "feeder"), signal.SIGKILL),
    "backend": lambda up: os.kill(backend_pid(up, "hot"), signal.SIGKILL),
    "sigterm": lambda up: up.proc.send_signal(signal.SIGTERM),
}


def run_scenario(
    tmp: Path,
    fault: str,
    *,
    streams: int = 3,
    stream_seconds: float = 6.0,
    held: int = 3,
    fault_after: float = 1.5,
    settle: float = 3.0,
) -> Record:
    """Start `up`, run traffic, inject `fault` after `fault_after` seconds, and record the outcome."""
    up = UpProcess(tmp, MODELS)
    try:
        up.wait_ready({"hot": 2}, timeout=120)
        traffic = Traffic(up.port, streams=streams, stream_seconds=stream_seconds, held=held)
        traffic.start()
        time.sleep(fault_after)
        fault_at = time.monotonic()
        FAULTS[fault](up)
        traffic.wait(timeout=stream_seconds + 90)
        if fault == "extproc-stall":
            time.sleep(max(0.0, fault_at + STALL_SECONDS + 0.5 - time.monotonic()))  # resumed: does it log errors?
        restarted = False
        cold_start = 0.0
        if fault != "sigterm":
            time.sleep(settle)  # probes after everything else ended: did the gateway come back?
            models = up.status()["models"]
            restarted = all(r["state"] == "ready" for m in models if m["key"] == "hot" for r in m["replicas"])
            cold_start = next(m["last_cold_start_seconds"] for m in models if m["key"] == "cold") or 0.0
        traffic.stop()
        if fault == "sigterm":
            up.proc.wait(60)  # it stops by itself; a second signal would mean "exit at once"
    finally:
        code = up.stop(timeout=60)
    after = [p for p in traffic.probes if p[1] >= fault_at]
    failed = [p for p in after if not p[2]]
    first_failure = min((p[0] for p in failed), default=None)
    served_later = [p for p in after if p[2] and first_failure is not None and p[0] > first_failure]
    slowest_held = max((done - traffic.held_sent for done in traffic.held_done), default=0.0)
    record = Record(
        fault=fault,
        streams=streams,
        streams_kept=sum(traffic.stream_results),
        held=held,
        held_ok=sum(1 for status, _ in traffic.held_results if status == 200),
        held_retriable=sum(1 for status, retry in traffic.held_results if status == 503 and retry),
        probes_after_fault=len(after),
        probes_failed=len(failed),
        recovery_seconds=round(max(p[1] for p in failed) - fault_at, 3) if failed else 0.0,
        slowest_probe_seconds=round(max((p[1] - p[0] for p in after), default=0.0), 3),
        failures=sorted({p[3] for p in failed})[:5],
        last_probes_ok=len(after) >= 3 and all(p[2] for p in after[-3:]),
        restarted_backend=restarted,
        exit_code=code,
        held_outcomes=sorted(f"{status} {retry}".strip() for status, retry in traffic.held_results),
        held_beyond_start_seconds=round(slowest_held - cold_start, 3) if fault != "sigterm" else 0.0,
        served_after_a_failure=len(served_later),
        log_errors=log_errors(up),
    )
    return record


_ERROR_LINE = re.compile(r" (ERROR|CRITICAL) |^Traceback ")


def log_errors(up: UpProcess) -> list[str]:
    """ERROR lines and tracebacks in what `up`, the feeder and the extprocs logged (Envoy's log and
    the backends' are not Python's logging)."""
    logs = [up.log_path, *sorted((up.state_dir / "logs").glob("extproc-*.log")), up.state_dir / "logs" / "feeder.log"]
    found = []
    for path in logs:
        if path.exists():
            found += [
                f"{path.name}: {line}"
                for line in path.read_text(errors="replace").splitlines()
                if _ERROR_LINE.search(line)
            ]
    return found
