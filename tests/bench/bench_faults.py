"""Fault benchmark: kill each gateway component of a real `wakegate up` under traffic; the table of docs/reliability.md.

Run from the repository root (not collected by `pytest tests`):

    python -m tests.bench.bench_faults [--repeat 3] [--faults extproc,extproc-both,...] [--json OUT]

Each round runs the scenarios of tests/support/faults.py, one fresh `wakegate up` each: three
streams of 6 s on a model with two replicas (10 s for SIGTERM), four requests held for a model
loading from zero (4 s), a prober sending one small request after another; after 1.5 s, the
fault (kill -9 of the extproc holding the cold requests, of both extprocs 0.5 s apart, SIGSTOP
of the holding one for 5 s, kill -9 of Envoy, the feeder, one backend replica; or SIGTERM to
`up`). Per fault it prints streams kept, held requests answered (200, or the retriable 503 +
Retry-After), how much longer than the cold start the slowest held request took, new requests
failed (probes after the fault that did not get a 200), the slowest probe after the fault, and
the time to recover (from the fault to the end of the last failed probe; 0 when none failed),
as the median over rounds (worst in brackets), then a Markdown table for the doc.

Targets (docs/reliability.md): an extproc death or stall loses no stream and no held request and
fails no new request; a stall delays no held or new request by more than 1.5 s; Envoy death
recovers within 2 s; SIGTERM lets a 10 s stream finish.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path

from tests.bench.common import git_state, loadavg
from tests.support.faults import FAULTS, Record, run_scenario

WHAT = {
    "extproc": "kill -9 extproc (the one holding the cold requests)",
    "extproc-both": "kill -9 both extprocs, 0.5 s apart",
    "extproc-stall": "SIGSTOP the holding extproc for 5 s",
    "envoy": "kill -9 Envoy",
    "feeder": "kill -9 the xDS feeder",
    "backend": "kill -9 one backend replica (of 2)",
    "sigterm": "SIGTERM to `wakegate up` (drain)",
}


def run(fault: str) -> Record:
    with tempfile.TemporaryDirectory(prefix=f"wg-fault-{fault}-") as tmp:
        return run_scenario(Path(tmp), fault, stream_seconds=10.0 if fault == "sigterm" else 6.0, held=4)


def _median_worst(values: list[float], worst: float) -> str:
    median = statistics.median(values)
    text = f"{median:g}"
    return text if worst == median else f"{text} ({worst:g})"


def table(records: dict[str, list[Record]]) -> str:
    lines = [
        "| fault | streams kept | held requests answered | held: waited past the cold start (s) "
        "| new requests failed | slowest new request (s) | time to recover (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for fault, runs in records.items():
        first = runs[0]
        kept = _median_worst([r.streams_kept for r in runs], min(r.streams_kept for r in runs))
        ok = _median_worst([r.held_ok for r in runs], min(r.held_ok for r in runs))
        retriable = _median_worst([r.held_retriable for r in runs], max(r.held_retriable for r in runs))
        failed = _median_worst([r.probes_failed for r in runs], max(r.probes_failed for r in runs))
        probes = int(statistics.median(r.probes_after_fault for r in runs))
        recover = _median_worst([r.recovery_seconds for r in runs], max(r.recovery_seconds for r in runs))
        served = [r for r in runs if r.held_ok]  # how long held requests waited, where any got 200
        beyond = (
            _median_worst(
                [r.held_beyond_start_seconds for r in served], max(r.held_beyond_start_seconds for r in served)
            )
            if served
            else "-"
        )
        slowest = _median_worst([r.slowest_probe_seconds for r in runs], max(r.slowest_probe_seconds for r in runs))
        held = f"{ok} got 200, {retriable} got 503 retriable (of {first.held})"
        if fault == "sigterm":  # new connections are refused on purpose: the listener closed
            failed, recover, beyond, slowest = f"all refused ({failed} of ~{probes}): draining", "-", "-", "-"
        else:
            failed = f"{failed} of ~{probes}"
        lines.append(
            f"| {WHAT[fault]} | {kept} / {first.streams} | {held} | {beyond} | {failed} | {slowest} | {recover} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="rounds over all faults; the table shows medians")
    ap.add_argument("--faults", default=",".join(FAULTS), help="comma-separated subset of " + ",".join(FAULTS))
    ap.add_argument("--json", type=Path, default=None, help="also write every record here as JSON")
    args = ap.parse_args()
    faults = [f for f in args.faults.split(",") if f]
    unknown = set(faults) - set(FAULTS)
    if unknown:
        ap.error(f"unknown faults: {sorted(unknown)}")
    print(f"# bench_faults {git_state()} load before {loadavg()}", flush=True)
    records: dict[str, list[Record]] = {f: [] for f in faults}
    for round_ in range(args.repeat):
        for fault in faults:
            record = run(fault)
            records[fault].append(record)
            print(f"round {round_ + 1} {json.dumps(dataclasses.asdict(record))}", flush=True)
    print(f"# load after {loadavg()}\n")
    print(table(records))
    if args.json is not None:
        args.json.write_text(
            json.dumps({f: [dataclasses.asdict(r) for r in rs] for f, rs in records.items()}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
