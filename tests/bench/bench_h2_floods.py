"""HTTP/2 floods against extproc while a prober measures the gateway's latency.

Run from the repository root (not collected by `pytest tests`):

    python -m tests.bench.bench_h2_floods [--seconds 5] [--json OUT] [--no-limit-flags]

It starts `wakegate up` with one sim-backed model on free loopback ports, then, for each attack
of tests/support/h2attack.py: the prober (one keep-alive client of the gateway, a small chat
completion after another, 5 ms apart) runs alone for 3 s, then during the attack. The attack
(in a process of its own) goes straight to extproc's HTTP/2 port for `--seconds`, on a new connection each time the
server ends one (an attacker that does not give up). "Frames sent" counts what the attacker
wrote into its sockets: the kernel takes a few MB per connection that the server never reads
once it has ended that connection, so it is far more than the server handled. Then the idle
case: 500 connections that send nothing, or only the preface, with preface_timeout=2 and
idle_timeout=2, and how long until the server closed them.

Recorded per attack: frames sent, connections used and how many of them the attacker saw
ended with GOAWAY ENHANCE_YOUR_CALM (the others were reset before it read the GOAWAY), the
prober's requests, p50 / p99 / max latency and failures, the same without the attack, and
extproc's CPU during the attack. `--no-limit-flags` leaves out `--extproc-h2-limit` (for a
checkout that predates it: the idle case then waits 30 s).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from tests.bench.common import git_state, loadavg
from tests.bench.procs import CLK_TCK, children_of, cmdline, proc_ticks
from tests.support import h2attack
from tests.support.up import UpProcess, model_doc

MODEL = "flood-bench"


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _latency(values: list[float]) -> dict[str, Any]:
    ms = [v * 1000 for v in values]
    return {
        "n": len(ms),
        "p50_ms": round(statistics.median(ms), 2) if ms else None,
        "p99_ms": round(_quantile(ms, 0.99), 2) if ms else None,
        "max_ms": round(max(ms), 2) if ms else None,
    }


def _refusals(up: UpProcess) -> dict[str, float]:
    try:
        return h2attack.refusals(up.child_arg("extproc-0", "--admin-listen"))
    except (OSError, ValueError):  # a checkout without the metric
        return {}


def _extproc_pid(up: UpProcess) -> int | None:
    for pid in children_of(up.proc.pid):
        if "wakegate.extproc" in cmdline(pid):
            return pid
    return None


def run_attack(
    up: UpProcess, port: int, attack: h2attack.Flood, seconds: float, attacker: ProcessPoolExecutor
) -> dict[str, Any]:
    pid = _extproc_pid(up)
    with h2attack.Prober(up.port, MODEL) as prober:
        time.sleep(3.0)
        baseline = list(prober.latencies)
        failures_before = len(prober.failures)
        start = time.monotonic()
        ticks = proc_ticks(pid) if pid else None
        refused = _refusals(up)
        outcome = attacker.submit(h2attack.flood, "127.0.0.1", port, attack, 10**12, seconds=seconds).result()
        cpu = (proc_ticks(pid) or 0) - ticks if pid and ticks is not None else None
        end = time.monotonic()
        time.sleep(0.2)
        after = _refusals(up)
    during = [lat for lat, stamp in zip(prober.latencies, prober.stamps, strict=True) if start <= stamp <= end + 0.2]
    return {
        "attack": attack.name,
        "frames": outcome.frames,
        "seconds": round(outcome.seconds, 2),
        "connections": len(outcome.ended),
        "calmed": outcome.calmed,
        "cut": outcome.cut,
        "refused": {k: v - refused.get(k, 0) for k, v in after.items() if v != refused.get(k, 0)},
        "extproc_cpu_pct": round(100.0 * cpu / CLK_TCK / outcome.seconds, 1) if cpu is not None else None,
        "baseline": _latency(baseline),
        "during": _latency(during),
        "failures": prober.failures[failures_before:],
    }


def run_idle(up: UpProcess, port: int, count: int = 500) -> dict[str, Any]:
    with h2attack.Prober(up.port, MODEL) as prober:
        start = time.monotonic()
        socks = h2attack.idle_connections("127.0.0.1", port, count // 2, preface=False)
        socks += h2attack.idle_connections("127.0.0.1", port, count - count // 2, preface=True)
        closed = sum(h2attack.closed_by_server(s, max(0.01, start + 30 - time.monotonic())) for s in socks)
        seconds = time.monotonic() - start
        for sock in socks:
            sock.close()
        during = list(prober.latencies)
    return {"attack": f"{count} idle / half-open connections", "connections": count, "closed": closed,
            "seconds": round(seconds, 2), "during": _latency(during), "failures": prober.failures}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="how long each attack goes on (default 5)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here as JSON")
    ap.add_argument("--no-limit-flags", action="store_true", help="do not pass --extproc-h2-limit to wakegate up")
    ap.add_argument("--only", default="", help="run only attacks whose name contains this")
    args = ap.parse_args(argv)
    extra: list[str] = []
    if not args.no_limit_flags:
        extra = ["--extproc-h2-limit", "preface_timeout=2", "--extproc-h2-limit", "idle_timeout=2"]
    record: dict[str, Any] = {"git": git_state(), "loadavg_before": loadavg(), "results": []}
    with tempfile.TemporaryDirectory(prefix="bench-h2-") as tmp:
        up = UpProcess(Path(tmp), model_doc(MODEL, extra="  scaling: {min: 1, max: 1}\n"), *extra)
        # The attacker runs in its own process: in the prober's, it would hold the GIL while it
        # builds frames and delay the prober's own clock.
        attacker = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        try:
            up.wait_ready({MODEL: 1}, timeout=90)
            port = h2attack.extproc_port(up.state_dir)
            for attack in h2attack.attacks():
                if args.only and args.only not in attack.name:
                    continue
                result = run_attack(up, port, attack, args.seconds, attacker)
                record["results"].append(result)
                print(json.dumps(result), flush=True)
            if not args.only or args.only in "idle":
                result = run_idle(up, port)
                record["results"].append(result)
                print(json.dumps(result), flush=True)
        finally:
            attacker.shutdown()
            up.stop()
    record["loadavg_after"] = loadavg()
    print()
    print("| attack | frames sent | s | connections (ended / GOAWAY read) | extproc CPU % | prober n | p50 ms | p99 ms "
          "| max ms | p99 without attack | failures |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in record["results"]:
        d, b = r["during"], r.get("baseline", {})
        sent = f"{r['frames']:,}" if "frames" in r else "-"
        conns = (f"{r['connections']} ({r['cut']} / {r['calmed']})" if "calmed" in r
                 else f"{r['connections']} ({r['closed']} closed)")  # fmt: skip
        cpu, quiet = r.get("extproc_cpu_pct", "-"), b.get("p99_ms", "-")
        print(f"| {r['attack']} | {sent} | {r['seconds']} | {conns} | {cpu} | {d['n']} "
              f"| {d['p50_ms']} | {d['p99_ms']} | {d['max_ms']} | {quiet} | {len(r['failures'])} |")  # fmt: skip
    print(f"load average before {record['loadavg_before']}, after {record['loadavg_after']}; git {record['git']}")
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
