"""h2spec (e2e/tools/h2spec.py) against extproc's own HTTP/2 server, started as `python -m wakegate.extproc`.

extproc accepts HTTP/2 connections without an xDS feeder too, after waiting
`UNSYNCED_SERVE_SECONDS` (5 s) for a route table (its route feed retries in the background), so
none runs here. Every one of h2spec's 145 cases applies to extproc's server
and passes, none skipped: h2spec's plain `GET /` gets a 415 with a text body (the server
speaks only gRPC), which is what the cases that need a response body read. The whole run
takes a few seconds; a failing case would wait out h2spec's 2 s timeout.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from e2e.procs import Proc
from e2e.tools import TOOLS
from e2e.tools.h2spec import parse_junit, run_h2spec
from wakegate.control.admin import free_port


@contextmanager
def running_extproc(logdir: Path) -> Iterator[int]:
    """`python -m wakegate.extproc` on free loopback ports; yields its gRPC (HTTP/2) port."""
    grpc, admin, activator, xds = (free_port() for _ in range(4))
    proc = Proc(
        "extproc",
        [
            sys.executable,
            "-m",
            "wakegate.extproc",
            "--listen",
            f"127.0.0.1:{grpc}",
            "--admin-listen",
            f"127.0.0.1:{admin}",
            "--activator-listen",
            f"127.0.0.1:{activator}",
            "--xds",
            f"127.0.0.1:{xds}",
            "--drain-seconds",
            "1",
        ],
        logdir / "extproc.log",
    )
    proc.start()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", grpc), timeout=1).close()
                break
            except OSError:
                if proc.exited() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"extproc did not listen on {grpc}:\n{proc.tail()}") from None
                time.sleep(0.05)
        yield grpc
    finally:
        proc.stop()


def test_h2spec_runs(h2spec_bin: Path) -> None:
    help_text = subprocess.run([str(h2spec_bin), "--help"], capture_output=True, text=True, timeout=30)
    assert help_text.returncode == 0
    assert "Conformance testing tool for HTTP/2" in help_text.stdout
    version = subprocess.run([str(h2spec_bin), "--version"], capture_output=True, text=True, timeout=30)
    pinned = TOOLS["h2spec"].version().lstrip("v").removesuffix("+incompatible")
    assert version.stdout.startswith(f"Version: {pinned} "), version.stdout


#: h2spec v2.2.1's cases (generic, http2 and hpack groups); a new pin may change the count.
H2SPEC_CASES = 145


def test_extproc_passes_every_h2spec_case(h2spec_bin: Path, tmp_path: Path) -> None:
    with running_extproc(tmp_path) as port:
        report = run_h2spec("127.0.0.1", port)
    assert len(report.cases) == H2SPEC_CASES, report.summary()
    assert not report.failed(), report.summary()
    skipped = [c.id for c in report.cases if c.outcome == "skipped"]
    assert not skipped, f"skipped (the server must advertise its limits and answer with a body): {skipped}"


def test_report_reads_failures_with_markup_in_them() -> None:
    # h2spec writes failure text into its JUnit XML unescaped.
    xml = """<?xml version="1.0" encoding="UTF-8"?>
<testsuites>
  <testsuite name="6.9. WINDOW_UPDATE" package="http2/6.9" id="6.9" tests="2" skipped="0" failures="0" errors="1">
    <testcase package="http2/6.9" classname="Sends a WINDOW_UPDATE frame" time="0.0010"></testcase>
    <testcase package="http2/6.9" classname="Sends a WINDOW_UPDATE frame on a stream" time="2.0000">
      <error>GOAWAY Frame (Error Code: PROTOCOL_ERROR)
Connection closed
DATA Frame <length:0></error>
    </testcase>
  </testsuite>
  <testsuite name="5.1.2. Stream Concurrency" package="http2/5.1.2" id="5.1.2" tests="1" skipped="1">
    <testcase package="http2/5.1.2" classname="Sends HEADERS frames" time="0.0000"><skipped></skipped></testcase>
  </testsuite>
</testsuites>"""
    cases = parse_junit(xml)
    assert [(c.id, c.outcome) for c in cases] == [
        ("http2/6.9/1", "passed"),
        ("http2/6.9/2", "failed"),
        ("http2/5.1.2/1", "skipped"),
    ]
    assert cases[1].detail == (
        "expected GOAWAY Frame (Error Code: PROTOCOL_ERROR) or Connection closed; got DATA Frame <length:0>"
    )
