"""What approximate prefix affinity adds to a pick: hashing, index lookup and recording, per prompt size.

    nice -n 10 .venv/bin/python -m tests.bench.bench_prefix [--runs 2000]

Prompts are chat bodies of English-like text at ~4 characters per token (a 32k-token prompt is
~128k characters), as the parsed JSON body extproc already holds. Reported per size: p50 and p90
of (a) the chain alone (:func:`prompt_text` + :func:`chain`), (b) a whole scored pick with the
``balanced`` profile over 8 endpoints whose index already holds 2 000 other chains, and (c) the
same pick with the ``load-first`` profile (no prefix work), so (b) - (c) is the prefix cost, and
(d) the precise scorer's block chain (:func:`wakegate.kvevents.body_blocks`) of a prompt of that
many sim tokens (whitespace words, BLAKE2b per 16; at most 4 096 blocks).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from tests.bench.common import git_state, loadavg
from wakegate.extproc.picking import Picker
from wakegate.extproc.prefix import chain, prompt_text
from wakegate.kvevents import body_blocks
from wakegate.v1 import routing_pb2

ENDPOINTS = [f"10.0.0.{i}:8000" for i in range(1, 9)]


def body(tokens: int, rng: random.Random) -> dict[str, object]:
    words = [
        rng.choice(("the", "model", "serves", "tokens", "fast", "cache", "prefix", "gateway")) for _ in range(tokens)
    ]
    text = " ".join(words)  # 5-7 characters a word with its space: ~4 chars per token of real text
    return {
        "model": "m",
        "messages": [{"role": "system", "content": text[: tokens * 4]}, {"role": "user", "content": "hi"}],
    }


def percentiles(samples: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(samples, n=10)
    return statistics.median(samples) * 1e6, q[8] * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2000)
    args = parser.parse_args(argv)
    rng = random.Random(7)
    pickers = {}
    for profile in ("balanced", "load-first"):
        picker = Picker()
        eps = [routing_pb2.Endpoint(address=e.split(":")[0], port=8000) for e in ENDPOINTS]
        picker.configure([routing_pb2.ModelRoute(key="m", endpoints=eps, profile=profile)])
        for i in range(2000):  # history: other prompts already routed
            picker.pick("m", "default", ENDPOINTS, {}, body(600, random.Random(i)))
        pickers[profile] = picker
    results = []
    for tokens in (1000, 8000, 32000):
        b = body(tokens, rng)
        words = " ".join(rng.choice(("the", "model", "serves", "tokens")) for _ in range(tokens))
        sim_body = {"model": "m", "messages": [{"role": "system", "content": words}]}
        timings: dict[str, list[float]] = {name: [] for name in ("chain", "pick_balanced", "pick_load_first")}
        timings["precise_blocks"] = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            chain(prompt_text(b))
            t1 = time.perf_counter()
            pickers["balanced"].pick("m", "default", ENDPOINTS, {}, b)
            t2 = time.perf_counter()
            pickers["load-first"].pick("m", "default", ENDPOINTS, {}, b)
            t3 = time.perf_counter()
            timings["chain"].append(t1 - t0)
            timings["pick_balanced"].append(t2 - t1)
            timings["pick_load_first"].append(t3 - t2)
            body_blocks(sim_body)
            timings["precise_blocks"].append(time.perf_counter() - t3)
        row: dict[str, object] = {
            "prompt_tokens": tokens,
            "chars": len(prompt_text(b)),
            "blocks": len(chain(prompt_text(b))),
        }
        for name, samples in timings.items():
            p50, p90 = percentiles(samples)
            row[f"{name}_p50_us"] = round(p50, 1)
            row[f"{name}_p90_us"] = round(p90, 1)
        row["prefix_cost_p50_us"] = round(float(row["pick_balanced_p50_us"]) - float(row["pick_load_first_p50_us"]), 1)  # type: ignore[arg-type]
        results.append(row)
    print(json.dumps({"loadavg": loadavg(), "git": git_state(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
