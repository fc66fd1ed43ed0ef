"""What sending one large message costs extproc's HTTP/2 server: `Stream.write_data` of messages
from 64 KiB to 4 MiB, cut into 16 KiB DATA frames.

Run from the repository root (not collected by `pytest tests`):

    python -m tests.bench.bench_h2send [--rounds 7] [--json OUT]

The connection writes into a sink (no socket), so the table is the framing work alone: the best
round's microseconds per message and per MiB. Sending is linear when the per-MiB column stays flat
as messages grow; a send that copied the rest of the message for every frame would grow it with
the message size (a 4 MiB message is 256 frames).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from tests.bench.common import git_state, loadavg
from wakegate.extproc.h2grpc.connection import Connection
from wakegate.extproc.h2grpc.frames import MAX_WINDOW
from wakegate.extproc.h2grpc.limits import H2Limits
from wakegate.extproc.h2grpc.stream import Stream

SIZES = {"64 KiB": 64 << 10, "256 KiB": 256 << 10, "1 MiB": 1 << 20, "4 MiB": 4 << 20}


class _Sink:
    def __init__(self) -> None:
        self.bytes = 0

    def write(self, data: bytes) -> None:
        self.bytes += len(data)


def send_us(size: int, budget: float = 0.2) -> float:
    """Microseconds to send one message of `size` bytes, in a loop of about `budget` seconds."""
    conn = Connection(cast(Any, SimpleNamespace(limits=H2Limits())))
    sink = _Sink()
    conn.transport = cast(Any, sink)
    message = bytes(size)
    n = 0
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < budget or n == 0:
        conn.send_window = MAX_WINDOW
        stream = Stream(conn, 1 + 2 * n)
        stream.send_window = MAX_WINDOW
        stream.write_data(message)
        n += 1
    assert sink.bytes >= n * size
    return elapsed / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = {}
    for name, size in SIZES.items():
        best = min(send_us(size) for _ in range(args.rounds))
        results[name] = {"us_per_message": round(best, 1), "us_per_mib": round(best / (size / (1 << 20)), 1)}
    print(f"{'message':>8} {'us/message':>11} {'us/MiB':>8}")
    for name, row in results.items():
        print(f"{name:>8} {row['us_per_message']:>11} {row['us_per_mib']:>8}")
    print(f"load average at the end: {loadavg()}")
    if args.json:
        args.json.write_text(json.dumps({"git": git_state(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
