"""Adapter placement on a sim fleet: how many LoRA loads each picking policy causes.

    nice -n 10 .venv/bin/python -m tests.bench.bench_lora [--replicas 3] [--adapters 20]
        [--max-adapters 4] [--requests 2000] [--clients 8] [--zipf 1.0] [--load-ms 0] [--json OUT]

`--replicas` real sim processes (`wakegate sim --enable-lora --max-loras N`, vLLM's run-time
adapter API) serve one base. Each request names one of `--adapters` adapters, drawn from a
Zipf(`--zipf`) popularity (seeded: the same sequence for every policy); `--clients` clients send
requests back to back. Before a request is sent, the chosen replica is made to hold its adapter
by `control/up/adapters.AdapterLoader` (`POST /v1/load_lora_adapter`, the least recently used
adapter unloaded first when the replica holds `--max-adapters`). Policies:

* ``affinity``  the gateway's own scheduling (extproc/scheduling.schedule, the balanced profile's
  weights): the adapter filters see which adapters each replica holds and its cap, so a replica
  that holds the adapter wins, then one with a free slot; the queue scorer breaks ties.
* ``least-loaded``  fewest requests in flight, adapters ignored.
* ``random``    a uniformly random replica.

Reported per policy: adapter loads and unloads, the share of requests answered without a load,
each load's latency (p50, p99; the engine call, with `--load-ms` simulated load time), requests
per replica (max/mean), and the wall time. The fleet is fresh for every policy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter
from typing import Any

import aiohttp

from tests.bench.common import git_state, loadavg
from tests.support.sim import start_sim
from wakegate import contract
from wakegate.control.up.adapters import AdapterLoader
from wakegate.extproc.scheduling import EngineState, Request, Rotation, Signals, schedule

POLICIES = ("affinity", "least-loaded", "random")


def workload(n: int, adapters: int, zipf: float, seed: int = 7) -> list[str]:
    weights = [1.0 / (rank**zipf) for rank in range(1, adapters + 1)]
    rng = random.Random(seed)
    return rng.choices([f"adapter-{i:02d}" for i in range(adapters)], weights=weights, k=n)


async def run_policy(policy: str, args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    sims = [
        start_sim(0, "--served-model-name", "base", "--enable-lora", "--max-loras", str(args.max_adapters),
                  "--lora-load-ms", str(args.load_ms))
        for _ in range(args.replicas)
    ]
    endpoints = [f"127.0.0.1:{sim.port}" for sim in sims]
    loader = AdapterLoader(args.max_adapters)
    inflight: Counter[str] = Counter()
    engines: dict[str, EngineState] = {}
    signals = Signals(lambda ep: inflight[ep], engines)
    rotation = Rotation()
    weights = dict(contract.PROFILES["balanced"])
    rng = random.Random(11)
    served: Counter[str] = Counter()
    without_load = 0
    queue = list(reversed(names))
    try:
        async with aiohttp.ClientSession() as session:

            def pick(adapter: str) -> str:
                if policy == "random":
                    return rng.choice(endpoints)
                if policy == "least-loaded":
                    low = min(inflight[ep] for ep in endpoints)
                    return rng.choice([ep for ep in endpoints if inflight[ep] == low])
                for ep in endpoints:
                    engines[ep] = EngineState(adapters=loader.slots(ep).names, max_adapters=args.max_adapters)
                decision = schedule(endpoints, weights, Request(adapter=adapter), signals, rotation)
                assert decision.endpoint is not None
                return decision.endpoint

            async def client() -> None:
                nonlocal without_load
                while queue:
                    adapter = queue.pop()
                    endpoint = pick(adapter)
                    inflight[endpoint] += 1
                    try:
                        if not await loader.ensure(session, endpoint, adapter, f"/adapters/{adapter}"):
                            without_load += 1
                        body = {"model": adapter, "prompt": "hello there", "max_tokens": 4}
                        try:
                            async with session.post(f"http://{endpoint}/v1/completions", json=body) as resp:
                                assert resp.status == 200, await resp.text()
                                await resp.read()
                        finally:
                            loader.release(endpoint, adapter)
                    finally:
                        inflight[endpoint] -= 1
                    served[endpoint] += 1

            started = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(args.clients)))
            wall = time.perf_counter() - started
    finally:
        for sim in sims:
            sim.stop(timeout=5)
    loads = sorted(loader.stats.load_seconds)
    counts = [served[ep] for ep in endpoints]
    return {
        "policy": policy,
        "loads": loader.stats.loads,
        "unloads": loader.stats.unloads,
        "answered_without_load": round(without_load / len(names), 4),
        "load_ms_p50": round(statistics.median(loads) * 1000, 2) if loads else None,
        "load_ms_p99": round(loads[min(len(loads) - 1, int(len(loads) * 0.99))] * 1000, 2) if loads else None,
        "imbalance": round(max(counts) / statistics.mean(counts), 3),
        "wall_s": round(wall, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--adapters", type=int, default=20)
    parser.add_argument("--max-adapters", type=int, default=4)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--load-ms", type=float, default=0.0)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    names = workload(args.requests, args.adapters, args.zipf)
    results = [asyncio.run(run_policy(p, args, names)) for p in args.policies.split(",")]
    report = {"args": vars(args), "loadavg": loadavg(), "git": git_state(), "results": results}
    for row in results:
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
