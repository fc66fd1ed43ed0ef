"""Routing quality: the same workloads through the real gateway, once per routing strategy.

    nice -n 10 .venv/bin/python -m tests.bench.bench_routing [--replicas 4] [--open-seconds 20]
        [--closed-seconds 10] [--closed-clients 32] [--workloads shared-prefix,multi-turn,no-sharing]
        [--json OUT]

For each workload one `wakegate up` runs one sim model per strategy (`--replicas` replicas each;
the models differ only in `routing`), so every strategy meets identical, cold engines:

* ``round-robin``    strategy round-robin: Envoy's round robin (before the default profile, what a
  Model that named no routing got)
* ``least-loaded``   strategy least-loaded: fewest requests in flight from the gateway
* ``prefix-hash``    strategy prefix: consistent hash of the first 1 024 prompt characters
* ``prefix-approx``  profile cache-first: the approximate prefix index alone (ties rotate)
* ``balanced``       profile balanced: approximate prefix 3 + queue 1 (the default profile: what a
  Model that names no routing gets)
* ``precise``        profile precise: precise prefix 3 (the engines' own KV events over ZMQ) + queue 1

Each sim is a small engine whose simulated time dwarfs the CPU it burns: a 16-token-block
prefix cache (``--kv-cache-tokens``), one prefill lane at ``--prefill-tokens-per-second``,
decode at 50 tokens/s slowed 2 % per extra running request, 8 running requests at most (more
wait). Workloads (seeded, identical for every strategy):

* ``shared-prefix``  12 system prompts of 2k-8k tokens, each request one of them (uniform) plus a
  50-150 token user turn; 24 output tokens. Fleet cache 4 x 32k tokens < the 60k of prompts.
* ``hot-prefix``     shared-prefix, but half the requests use the first system prompt: one prefix
  is hot, so affinity alone would pile onto one replica.
* ``multi-turn``     conversations (a 1.5k-token opening document, then 5 turns of 80-120 tokens,
  each re-sending the whole history with the sim's real answers); think time ~ Exp(2 s).
* ``no-sharing``     unique random prompts of 500-2 500 tokens; 24 output tokens.

Open loop: Poisson arrivals (conversation starts for multi-turn) at a rate that keeps round
robin's prefill lanes ~75 % busy, for ``--open-seconds``; every request that was started is
waited for. Closed loop: ``--closed-clients`` clients each send their next request the moment
the previous answer ends, for ``--closed-seconds``. Reported per run: TTFT p50/p90/p99 and mean,
end-to-end p50/p99, output tokens/s (completed output tokens over the run's span), per-replica
prefix-cache hit rate (from each sim's ``vllm:prefix_cache_*`` counters), load imbalance (max over
mean of requests per replica) and the prefill lanes' busy share.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from tests.bench.common import git_state, loadavg
from tests.support.up import UpProcess, model_doc

STRATEGIES: dict[str, str] = {
    "round-robin": "{strategy: round-robin}",
    "least-loaded": "{strategy: least-loaded}",
    "prefix-hash": "{strategy: prefix}",
    "prefix-approx": "{profile: cache-first}",
    "balanced": "{profile: balanced}",
    "precise": "{profile: precise, kvEvents: {portOffset: 1, replayPortOffset: 2}}",
}
MODEL_OF = {
    "round-robin": "rr",
    "least-loaded": "ll",
    "prefix-hash": "ph",
    "prefix-approx": "pa",
    "balanced": "bal",
    "precise": "pre",
}
#: sim flags one strategy needs beyond the common ones (its engines publish KV events)
EXTRA_ARGS = {
    "precise": ', --kv-events-config, \'{"enable_kv_cache_events": true, "publisher": "zmq", '
    '"endpoint": "tcp://*:+1", "replay_endpoint": "tcp://*:+2", "topic": "kv-events"}\'',
}

OUTPUT_TOKENS = 24
PREFILL_TPS = 5000.0
VOCAB = [
    "".join(chr(97 + (i * 7 + j * 3) % 26) for j in range(2 + i % 6)) for i in range(2000)
]  # 2-7 letter pseudo-words: a sim token each


@dataclass(frozen=True)
class Workload:
    name: str
    kv_cache_tokens: int
    open_rate: float  # requests/s (conversation starts/s for multi-turn)


WORKLOADS = {
    "shared-prefix": Workload("shared-prefix", 32768, 5.4),
    "hot-prefix": Workload("hot-prefix", 32768, 5.4),
    "multi-turn": Workload("multi-turn", 16384, 2.5),
    "no-sharing": Workload("no-sharing", 32768, 10.0),
}


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(VOCAB, k=n))


@dataclass
class Sample:
    ttft: float
    e2e: float
    tokens: int
    done_at: float


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)
    errors: int = 0
    started: float = 0.0


async def stream_chat(session: aiohttp.ClientSession, url: str, body: dict[str, Any], run: Run) -> str | None:
    """One streamed chat completion; records a Sample; returns the answer text (None on error)."""
    t0 = time.monotonic()
    first = None
    pieces: list[str] = []
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                run.errors += 1
                await resp.read()
                return None
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        if first is None:
                            first = time.monotonic()
                        pieces.append(text)
    except (aiohttp.ClientError, TimeoutError):
        run.errors += 1
        return None
    end = time.monotonic()
    if first is None:
        run.errors += 1
        return None
    run.samples.append(Sample(first - t0, end - t0, len(pieces), end))
    return "".join(pieces)


def chat_body(model: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    return {"model": model, "messages": messages, "max_tokens": OUTPUT_TOKENS, "stream": True}


class Generator:
    """The workload's requests, deterministic from a seed; the same for every strategy."""

    def __init__(self, workload: str, seed: int) -> None:
        self.workload = workload
        rng = random.Random(seed)
        self.systems = [words(rng, rng.randint(2000, 8000)) for _ in range(12)]

    def single(self, rng: random.Random) -> list[dict[str, str]]:
        if self.workload in ("shared-prefix", "hot-prefix"):
            hot = self.workload == "hot-prefix" and rng.random() < 0.5
            system = self.systems[0] if hot else rng.choice(self.systems)
            return [
                {"role": "system", "content": system},
                {"role": "user", "content": words(rng, rng.randint(50, 150))},
            ]
        return [{"role": "user", "content": words(rng, rng.randint(500, 2500))}]

    async def conversation(
        self, rng: random.Random, send: Callable[[list[dict[str, str]]], Awaitable[str | None]], think: bool
    ) -> None:
        messages = [{"role": "system", "content": words(rng, 1500)}]
        thinks = [rng.expovariate(1 / 2.0) for _ in range(5)]
        for turn in range(5):
            messages.append({"role": "user", "content": words(rng, rng.randint(80, 120))})
            answer = await send(messages)
            if answer is None:
                return
            messages.append({"role": "assistant", "content": answer})
            if think and turn < 4:
                await asyncio.sleep(thinks[turn])


async def open_loop(gen: Generator, wl: Workload, url: str, model: str, seconds: float, seed: int) -> Run:
    rng = random.Random(seed)
    arrivals: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(wl.open_rate)
        if t >= seconds:
            break
        arrivals.append(t)
    seeds = [rng.randrange(1 << 30) for _ in arrivals]
    run = Run()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def send(messages: list[dict[str, str]]) -> str | None:
            return await stream_chat(session, url, chat_body(model, messages), run)

        async def one(at: float, s: int) -> None:
            await asyncio.sleep(max(0.0, run.started + at - time.monotonic()))
            r = random.Random(s)
            if wl.name == "multi-turn":
                await gen.conversation(r, send, think=True)
            else:
                await send(gen.single(r))

        run.started = time.monotonic()
        await asyncio.gather(*(one(at, s) for at, s in zip(arrivals, seeds, strict=True)))
    return run


async def closed_loop(
    gen: Generator, wl: Workload, url: str, model: str, seconds: float, clients: int, seed: int
) -> Run:
    run = Run()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def send(messages: list[dict[str, str]]) -> str | None:
            if time.monotonic() - run.started > seconds:
                return None
            return await stream_chat(session, url, chat_body(model, messages), run)

        async def client(c: int) -> None:
            rng = random.Random(seed * 1000 + c)
            while time.monotonic() - run.started < seconds:
                if wl.name == "multi-turn":
                    await gen.conversation(rng, send, think=False)
                else:
                    await send(gen.single(rng))

        run.started = time.monotonic()
        await asyncio.gather(*(client(c) for c in range(clients)))
    return run


_SAMPLE = re.compile(r'^(vllm:[a-z_]+?)(?:_total)?\{[^}]*?(?:finished_reason="(\w+)")?[^}]*\} (\S+)$', re.M)


async def scrape(endpoints: list[str]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    async with aiohttp.ClientSession() as session:
        for ep in endpoints:
            async with session.get(f"http://{ep}/metrics") as resp:
                text = await resp.text()
            values: dict[str, float] = {}
            for name, _reason, value in _SAMPLE.findall(text):
                key = "vllm:requests" if name == "vllm:request_success" else name
                values[key] = values.get(key, 0.0) + float(value)
            out[ep] = values
    return out


Q, H = "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(run: Run, before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    ttft = [s.ttft for s in run.samples]
    e2e = [s.e2e for s in run.samples]
    span = (max(s.done_at for s in run.samples) - run.started) if run.samples else float("nan")
    hit_rates, requests, busy = [], [], []
    for ep in sorted(after):
        d = {k: after[ep].get(k, 0.0) - before[ep].get(k, 0.0) for k in after[ep]}
        q = d.get("vllm:prefix_cache_queries", 0.0)
        h = d.get("vllm:prefix_cache_hits", 0.0)
        hit_rates.append(round(h / q, 3) if q else 0.0)
        requests.append(d.get("vllm:requests", 0.0))
        busy.append((q - h) / PREFILL_TPS / span if span == span and span > 0 else 0.0)
    mean_req = statistics.fmean(requests) if requests else 0.0
    total_queries = sum(after[ep].get(Q, 0.0) - before[ep].get(Q, 0.0) for ep in after)
    total_hits = sum(after[ep].get(H, 0.0) - before[ep].get(H, 0.0) for ep in after)
    return {
        "requests": len(run.samples),
        "errors": run.errors,
        "ttft_mean_s": round(statistics.fmean(ttft), 3) if ttft else None,
        "ttft_p50_s": round(pct(ttft, 0.5), 3),
        "ttft_p90_s": round(pct(ttft, 0.9), 3),
        "ttft_p99_s": round(pct(ttft, 0.99), 3),
        "e2e_p50_s": round(pct(e2e, 0.5), 3),
        "e2e_p99_s": round(pct(e2e, 0.99), 3),
        "output_tokens_per_s": round(sum(s.tokens for s in run.samples) / span, 1) if span == span else None,
        "hit_rate_per_replica": hit_rates,
        "hit_rate": round(total_hits / total_queries, 3) if total_queries else 0.0,
        "imbalance": round(max(requests) / mean_req, 2) if mean_req else None,
        "prefill_busy": round(statistics.fmean(busy), 2) if busy else None,
    }


def models_yaml(wl: Workload, replicas: int, strategies: list[str] | None = None) -> str:
    args = (
        f'--prefill-tokens-per-second, "{PREFILL_TPS:g}", --tokens-per-second, "50", --batch-slowdown, "0.02", '
        f'--max-concurrency, "8", --kv-cache-tokens, "{wl.kv_cache_tokens}", --ttft-ms, "5", --max-model-len, "32768"'
    )
    return "".join(
        model_doc(
            MODEL_OF[name],
            extra=f"  args: [{args}{EXTRA_ARGS.get(name, '')}]\n  routing: {STRATEGIES[name]}\n"
            f"  scaling: {{min: {replicas}, max: {replicas}}}\n",
        )
        for name in strategies or STRATEGIES
    )


async def bench_workload(args: argparse.Namespace, wl: Workload, tmp: Path) -> list[dict[str, Any]]:
    up = UpProcess(tmp, models_yaml(wl, args.replicas, args.strategies))
    rows: list[dict[str, Any]] = []
    try:
        up.wait_ready({MODEL_OF[s]: args.replicas for s in args.strategies}, timeout=180)
        url = f"{up.url}/v1/chat/completions"
        gen = Generator(wl.name, seed=11)
        for strategy in args.strategies:
            model = MODEL_OF[strategy]
            eps = up.endpoints(model)
            for mode in args.modes:
                before = await scrape(eps)
                if mode == "open":
                    run = await open_loop(gen, wl, url, model, args.open_seconds, seed=23)
                else:
                    run = await closed_loop(gen, wl, url, model, args.closed_seconds, args.closed_clients, seed=29)
                after = await scrape(eps)
                row = {"workload": wl.name, "mode": mode, "strategy": strategy, **summarize(run, before, after)}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        up.stop()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| workload | load | strategy | TTFT mean | p50 | p90 | p99 | e2e p50 | e2e p99 | out tok/s | hit rate "
        "(per replica) | imbalance | prefill busy | errors |"
    )
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        per = " ".join(f"{h:.2f}" for h in r["hit_rate_per_replica"])
        lines.append(
            f"| {r['workload']} | {r['mode']} | {r['strategy']} | {r['ttft_mean_s']} | {r['ttft_p50_s']} | "
            f"{r['ttft_p90_s']} | {r['ttft_p99_s']} | {r['e2e_p50_s']} | {r['e2e_p99_s']} | "
            f"{r['output_tokens_per_s']} | {r['hit_rate']:.2f} ({per}) | {r['imbalance']} | {r['prefill_busy']} | "
            f"{r['errors']} |"
        )
    return "\n".join(lines)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--open-seconds", type=float, default=20.0)
    parser.add_argument("--closed-seconds", type=float, default=10.0)
    parser.add_argument("--closed-clients", type=int, default=32)
    parser.add_argument("--workloads", default="shared-prefix,multi-turn,no-sharing,hot-prefix")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--modes", default="open,closed")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="multiply every workload's open-loop rate")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # stop `wakegate up` on the way out
    args.strategies = [s for s in args.strategies.split(",") if s]
    args.modes = [m for m in args.modes.split(",") if m]
    load_before = loadavg()
    rows: list[dict[str, Any]] = []
    for name in args.workloads.split(","):
        base = WORKLOADS[name]
        wl = Workload(base.name, base.kv_cache_tokens, base.open_rate * args.rate_scale)
        tmp = Path(tempfile.mkdtemp(prefix=f"bench-routing-{name}-"))
        try:
            rows += asyncio.run(bench_workload(args, wl, tmp))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    result = {"loadavg_before": load_before, "loadavg_after": loadavg(), "git": git_state(), "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(table(rows))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
