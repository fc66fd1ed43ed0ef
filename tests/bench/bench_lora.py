"""Adapter placement on a sim fleet: how many LoRA loads each placement causes.

    nice -n 10 .venv/bin/python -m tests.bench.bench_lora [--mode gateway|direct] [--replicas 3]
        [--adapters 20] [--max-adapters 4] [--requests 1000] [--clients 8] [--zipf 1.0]
        [--load-ms 20] [--policies ...] [--json OUT]

Each request names one of `--adapters` adapters, drawn from a Zipf(`--zipf`) popularity (seeded:
the same sequence for every policy); `--clients` clients send requests back to back. Every
policy gets a fresh fleet of `--replicas` real sim processes with vLLM's run-time adapter API
(`--enable-lora --max-loras N --lora-load-ms MS`).

``--mode gateway`` (the default) runs the whole product: `wakegate up` with one base of
`--replicas` replicas (`maxAdapters` = `--max-adapters`) and `--adapters` LoRAAdapters, requests
through Envoy and extproc. The policies are the base's `spec.adapters.placement`:

* ``affinity``  a request goes to a replica that holds its adapter; when none does, it is held
  and `up` loads it (a free slot first, else evicting the least recently used adapter in no use).
* ``random``    a request goes to a random replica, which loads the adapter if it lacks it.

Reported per policy: adapter loads and unloads (`up`'s /status), the share of requests answered
without waiting for a load (the gateway's `wakegate_gateway_adapter_requests_total`), each load's
latency as `up` timed the engine call (p50, p95), the requests' own latency at the client (p50,
p95, p99: a request that waits for a load pays the unload before it, when one must make room),
and the wall time.

``--mode direct`` skips the gateway: the bench itself places each request (the gateway's scoring
filters, least-loaded, or random) and loads adapters with `control/up/adapters.AdapterLoader`; it
measures the placement rule alone (policies ``affinity``, ``least-loaded``, ``random``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from tests.bench.common import git_state, loadavg
from tests.support.sim import start_sim
from tests.support.up import UpProcess, adapter_doc, model_doc
from wakegate import contract
from wakegate.control.up.adapters import AdapterLoader
from wakegate.extproc.scheduling import EngineState, Request, Rotation, Signals, schedule

POLICIES = ("affinity", "least-loaded", "random")
PLACEMENTS = ("affinity", "random")


def workload(n: int, adapters: int, zipf: float, seed: int = 7) -> list[str]:
    weights = [1.0 / (rank**zipf) for rank in range(1, adapters + 1)]
    rng = random.Random(seed)
    return rng.choices([f"adapter-{i:02d}" for i in range(adapters)], weights=weights, k=n)


async def run_policy(policy: str, args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    sims = [
        start_sim(
            0,
            "--served-model-name",
            "base",
            "--enable-lora",
            "--max-loras",
            str(args.max_adapters),
            "--lora-load-ms",
            str(args.load_ms),
        )
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
        "mode": "direct",
        "policy": policy,
        "loads": loader.stats.loads,
        "unloads": loader.stats.unloads,
        "answered_without_load": round(without_load / len(names), 4),
        "load_ms_p50": round(statistics.median(loads) * 1000, 2) if loads else None,
        "load_ms_p99": round(loads[min(len(loads) - 1, int(len(loads) * 0.99))] * 1000, 2) if loads else None,
        "imbalance": round(max(counts) / statistics.mean(counts), 3),
        "wall_s": round(wall, 2),
    }


def fleet(args: argparse.Namespace, placement: str) -> str:
    """A `wakegate up` manifest: one always-on base of `--replicas` sims and `--adapters` adapters."""
    extra = f"""  args: [--lora-load-ms, "{args.load_ms}"]
  adapters: {{maxAdapters: {args.max_adapters}, placement: {placement}, idleTimeout: 3600}}
  scaling: {{min: {args.replicas}, max: {args.replicas}, idleTimeout: 3600, activationTimeout: 120}}
  endpoint: {{maxQueue: 1000}}
"""
    names = [f"adapter-{i:02d}" for i in range(args.adapters)]
    return model_doc("base", extra=extra) + "".join(adapter_doc(n, "base", f"file://adapters/{n}") for n in names)


def counter(text: str, name: str, label: str) -> dict[str, float]:
    """label value -> the sample of counter `name` in a Prometheus text exposition."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") and f'{label}="' in line:
            value = line.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[value] = out.get(value, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def percentile(values: list[float], share: float) -> float | None:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * share))] * 1000, 1) if ordered else None


async def run_gateway(placement: str, args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as folder:
        tmp = Path(folder)
        for i in range(args.adapters):
            (tmp / "adapters" / f"adapter-{i:02d}").mkdir(parents=True)
        up = UpProcess(tmp, fleet(args, placement))
        try:
            await asyncio.to_thread(up.wait_ready, {"base": args.replicas}, 120)
            latencies: list[float] = []
            queue = list(reversed(names))
            async with aiohttp.ClientSession() as session:

                async def client() -> None:
                    while queue:
                        adapter = queue.pop()
                        body = {"model": adapter, "prompt": "hello there", "max_tokens": 4}
                        sent = time.perf_counter()
                        async with session.post(f"{up.base_url}/completions", json=body) as resp:
                            answer = await resp.json()
                            assert resp.status == 200 and answer["model"] == adapter, answer
                        latencies.append(time.perf_counter() - sent)

                started = time.perf_counter()
                await asyncio.gather(*(client() for _ in range(args.clients)))
                wall = time.perf_counter() - started
            status = next(m for m in up.status()["models"] if m["key"] == "base")
            with urllib.request.urlopen(f"http://127.0.0.1:{up.admin_port}/metrics/gateway", timeout=5) as resp:
                gateway = resp.read().decode()
        finally:
            up.stop()
    outcomes = counter(gateway, "wakegate_gateway_adapter_requests_total", "outcome")
    summary = status["adapter_loads"]
    return {
        "mode": "gateway",
        "policy": placement,
        "loads": summary["loads"],
        "unloads": sum(a["unloads"] for a in status["adapters"].values()),
        "answered_without_load": round(outcomes.get("direct", 0.0) / len(names), 4),
        "load_ms_p50": None if summary["p50_seconds"] is None else round(summary["p50_seconds"] * 1000, 2),
        "load_ms_p95": None if summary["p95_seconds"] is None else round(summary["p95_seconds"] * 1000, 2),
        "request_ms_p50": percentile(latencies, 0.5),
        "request_ms_p95": percentile(latencies, 0.95),
        "request_ms_p99": percentile(latencies, 0.99),
        "wall_s": round(wall, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("gateway", "direct"), default="gateway")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--adapters", type=int, default=20)
    parser.add_argument("--max-adapters", type=int, default=4)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--load-ms", type=float, default=20.0)
    parser.add_argument("--policies", help="comma-separated (default: every policy of the mode)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    names = workload(args.requests, args.adapters, args.zipf)
    runner = run_gateway if args.mode == "gateway" else run_policy
    policies = args.policies.split(",") if args.policies else PLACEMENTS if args.mode == "gateway" else POLICIES
    results = [asyncio.run(runner(p, args, names)) for p in policies]
    report = {"args": vars(args), "loadavg": loadavg(), "git": git_state(), "results": results}
    for row in results:
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
