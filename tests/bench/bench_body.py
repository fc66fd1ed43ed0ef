"""What reading a request body costs extproc: `parse_json_body` on bodies of several shapes.

Run from the repository root (not collected by `pytest tests`):

    python -m tests.bench.bench_body [--rounds 7] [--json OUT]

Each shape is parsed in a loop for about 0.2 s per round; the table shows the best round's
microseconds per body (the least disturbed by other load). The shapes: the gateway benchmark's
own small chat body, a 2 KB chat message, a 300-message conversation, a 1.3 MB prompt of code
(brackets inside strings, so the exact depth check runs), a 100,000-token embeddings input,
and a body nested 120 levels deep in 6,000 places (the exact check's worst case under the limit).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tests.bench.common import git_state, loadavg
from wakegate.extproc.naming import parse_json_body

CODE = "def f(x):\n    return [x[i] for i in range(10)] + {'a': [1, 2]}\n" * 20_000


def bodies() -> dict[str, bytes]:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hello there " * 150}]}
    turn = {"role": "user", "content": 'hi "there" \\ x' * 20}
    return {
        "bench (small chat)": b'{"model":"bench-model","messages":[{"role":"user","content":"hi"}],"max_tokens":16}',
        "chat 2 KB": json.dumps(chat).encode(),
        "300 messages": json.dumps({"model": "m", "messages": [turn] * 300}).encode(),
        "code prompt 1.3 MB": json.dumps({"model": "m", "messages": [{"role": "user", "content": CODE}]}).encode(),
        "embeddings 100k tokens": json.dumps({"model": "m", "input": [list(range(100_000))]}).encode(),
        "120 deep x 6000": b'{"model":"m","x":[' + b",".join([b"[" * 118 + b"]" * 118] * 6000) + b"]}",
    }


def per_body_us(body: bytes, budget: float = 0.2) -> float:
    n, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < budget or n < 3:
        parse_json_body(body)
        n += 1
    return elapsed / n * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.bench_body", description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    shapes = bodies()
    best = {name: min(per_body_us(body) for _ in range(args.rounds)) for name, body in shapes.items()}
    print(f"git {git_state()}  load {loadavg()}")
    print(f"{'body':24} {'bytes':>10} {'µs/body':>10}")
    for name, us in best.items():
        print(f"{name:24} {len(shapes[name]):>10} {us:>10.1f}")
    if args.json:
        args.json.write_text(json.dumps(best, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
