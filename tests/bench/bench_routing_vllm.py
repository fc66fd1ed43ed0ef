"""Precise prefix routing on real vLLM: does the gateway send a prompt to the replica whose vLLM
holds its prefix, and does that beat the approximate index and round robin?

    nice -n 10 .venv/bin/python -m tests.bench.bench_routing_vllm [--prompts 12] [--uses 3] [--json OUT]

For each strategy one `wakegate up` runs one vLLM Model (the CPU build `python -m e2e.engines`
installs, on a generated Hugging Face folder: `e2e.hfmodel`, seed 0) with two replicas, fresh, so
every strategy meets identical, empty engines:

* ``round-robin``  strategy round-robin (Envoy's round robin);
* ``approximate``  profile cache-first: the gateway's own index of which prefix it sent where;
* ``precise``      profile precise: which blocks each vLLM says it holds (its KV events over ZMQ),
  matched by hashing the prompt as vLLM does (the model's chat template and tokenizer, vLLM's
  SHA-256 chain, the block size from its events).

The workload (seeded, identical for each strategy): ``--prompts`` system prompts of about 300
tokens (two of vLLM's 128-token CPU blocks, under the 512-token context), then two phases:

1. **Elsewhere**: each system prompt is sent once straight to one replica (alternating), as
   another gateway in front of the same engines, or this one before a restart, would have sent
   it. The gateway does not see these requests; the engines cache their prefixes.
2. **Measured**: through the gateway, ``--uses`` requests per system prompt in a seeded order,
   each with a new short question, one at a time (load plays no part), 2 output tokens, streamed.

Reported per strategy, over phase 2 only: vLLM's own prefix-cache hit rate (the
``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` deltas, all replicas),
mean time to first token, and which replica each prompt's requests went to (the share of
requests sent to the replica that was warmed with that prompt).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from e2e import engines, hfmodel
from tests.bench.common import first_token_seconds, git_state, loadavg, system_chat
from tests.engines.conftest import vllm_model
from tests.engines.test_up_engines import engines_path
from tests.support.up import UpProcess
from wakegate import promtext
from wakegate.extproc.engineprompt import EnginePrompt

STRATEGIES = {
    "round-robin": "{strategy: round-robin}",
    "approximate": "{profile: cache-first}",
    "precise": "{profile: precise, kvEvents: {portOffset: 1, replayPortOffset: 2}}",
}
PREFIX_CACHE = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
WORDS = hfmodel.CORPUS.replace(";", " ").replace(",", " ").replace(".", " ").replace("?", " ").split()


def fleet(routing: str) -> str:
    return vllm_model(routing, "{min: 2, max: 2, idleTimeout: 3600, activationTimeout: 600}")


def metrics(endpoint: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for name, _labels, value in promtext.samples(text, PREFIX_CACHE):
        out[name] = out.get(name, 0.0) + value
    return out


def ask(base: str, model: str, system: str, user: str) -> float:
    """Time to the first streamed token of one chat request to ``base`` (a gateway or an engine)."""
    return first_token_seconds(f"{base.rstrip('/')}/chat/completions", system_chat(model, system, user, 2))


def system_prompts(prompt: EnginePrompt, count: int, rng: random.Random) -> list[str]:
    """``count`` distinct system prompts of 280-360 tokens (two full 128-token blocks and some)."""
    out = []
    while len(out) < count:
        words = [f"topic{len(out)}:", *rng.choices(WORDS, k=90)]
        text = " ".join(words)
        while (n := len(prompt.token_ids({"messages": [{"role": "system", "content": text}]}) or [])) < 280:
            text += " " + " ".join(rng.choices(WORDS, k=10))
        if n <= 360:
            out.append(text)
    return out


def run(strategy: str, tmp: Path, model: Path, vllm: Path, systems: list[str], order: list[int]) -> dict[str, Any]:
    folder = tmp / strategy
    (folder / "weights").mkdir(parents=True)
    shutil.copytree(model, folder / "weights" / "tiny")
    up = UpProcess(folder, fleet(STRATEGIES[strategy]), env=engines_path(vllm))
    try:
        started = time.monotonic()
        up.wait_ready({"tiny": 2}, timeout=900)
        start_s = time.monotonic() - started
        endpoints = sorted(up.endpoints("tiny"))
        if strategy == "precise":  # the gateways subscribe within a second of the route
            time.sleep(3)
        warmed = {}
        for i, system in enumerate(systems):  # phase 1: elsewhere, straight to one replica
            warmed[i] = endpoints[i % 2]
            ask(f"http://{warmed[i]}/v1", "org/tiny-hf", system, "hello")
        time.sleep(2)  # the engines' events reach the gateway
        before = {ep: metrics(ep) for ep in endpoints}
        ttft = []
        placed: list[tuple[int, str]] = []
        for n, i in enumerate(order):  # phase 2: through the gateway
            counts = {ep: metrics(ep).get("vllm:prefix_cache_queries_total", 0.0) for ep in endpoints}
            question = f"question {n}: what about {random.Random(n).choice(WORDS)}?"
            ttft.append(ask(up.base_url, "tiny", systems[i], question))
            after_one = {ep: metrics(ep).get("vllm:prefix_cache_queries_total", 0.0) for ep in endpoints}
            served = max(endpoints, key=lambda ep: after_one[ep] - counts[ep])
            placed.append((i, served))
        after = {ep: metrics(ep) for ep in endpoints}

        def delta(name: str) -> float:
            return sum(after[ep].get(name, 0.0) - before[ep].get(name, 0.0) for ep in endpoints)

        hits, queries = delta("vllm:prefix_cache_hits_total"), delta("vllm:prefix_cache_queries_total")
        return {
            "replicas_ready_s": round(start_s, 1),
            "prefix_hit_rate": round(hits / queries, 3) if queries else None,
            "prompt_tokens": int(queries),
            "hit_tokens": int(hits),
            "ttft_mean_s": round(statistics.fmean(ttft), 4),
            "ttft_p50_s": round(statistics.median(ttft), 4),
            "to_warmed_replica": round(sum(ep == warmed[i] for i, ep in placed) / len(placed), 3),
            "requests_per_replica": {ep: sum(e == ep for _, e in placed) for ep in endpoints},
        }
    finally:
        up.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--uses", type=int, default=3)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    vllm = engines.ensure("vllm")
    tmp = Path(tempfile.mkdtemp(prefix="bench-routing-vllm-"))
    try:
        model = hfmodel.write_model(tmp / "tiny", hfmodel.HFModelSpec(seed=0))
        rng = random.Random(7)
        systems = system_prompts(EnginePrompt(model), args.prompts, rng)
        order = [i for i in range(args.prompts) for _ in range(args.uses)]
        rng.shuffle(order)
        results: dict[str, Any] = {"loadavg_before": loadavg()}
        for strategy in args.strategies.split(","):
            results[strategy] = run(strategy, tmp, model, vllm, systems, order)
            print(json.dumps({strategy: results[strategy]}), flush=True)
        results["loadavg_after"] = loadavg()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = {"git": git_state(), "prompts": args.prompts, "uses": args.uses, "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
