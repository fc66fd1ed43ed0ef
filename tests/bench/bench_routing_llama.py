"""Direction check on a real engine: does prefix-aware picking raise llama-server's prompt-cache reuse?

    nice -n 10 .venv/bin/python -m tests.bench.bench_routing_llama [--requests 40] [--json OUT]

One `wakegate up` runs two models over the same generated GGUF (`e2e.tinymodel`, seed 0), two
llama-server replicas each (one slot per replica, `--parallel 1`, and no host-memory prompt
cache, `--cache-ram 0`, so a replica's prompt cache is its last prompt): ``rr`` (strategy
round-robin, Envoy's round robin) and ``bal`` (profile balanced). The same sequence of chat
requests (2 system prompts of 450 words, ~1 600 tokens of the tiny vocabulary, in a seeded random order,
each with a short user turn, 4 output tokens) is sent to each model, one request at a time, so
load plays no part. Reported per model: prompt tokens the replicas computed and took from their
cache (``llamacpp:prompt_tokens_total`` / ``llamacpp:prompt_tokens_cached_total`` deltas), and
mean time to first token. Needs e2e/.bin/llama-server (`python -m e2e.engines llama-server`, or
copied from a finished CI build).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from e2e.tinymodel import ModelSpec, write_model
from tests.bench.common import REPO_ROOT, first_token_seconds, git_state, loadavg, system_chat
from tests.support.up import UpProcess, model_doc

BIN = REPO_ROOT / "e2e" / ".bin"
MODELS = {"rr": "{strategy: round-robin}", "bal": "{profile: balanced}"}
WORDS = ("the", "model", "serves", "tokens", "fast", "from", "a", "cache", "near", "each", "prefix", "of", "every")


def metrics(endpoint: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("llamacpp:"):
            name, _, value = line.partition(" ")
            out[name] = float(value)
    return out


def ask(url: str, model: str, system: str, user: str) -> float:
    return first_token_seconds(url, system_chat(model, system, user, 4), timeout=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not (BIN / "llama-server").exists():
        raise SystemExit(f"no {BIN / 'llama-server'}: build it with `python -m e2e.engines llama-server`")
    tmp = Path(tempfile.mkdtemp(prefix="bench-routing-llama-"))
    os.environ["PATH"] = f"{BIN}{os.pathsep}{os.environ['PATH']}"  # `wakegate up` starts `llama-server`
    gguf = write_model(tmp / "tiny.gguf", ModelSpec(seed=0))
    engine_args = f'[--model, "{gguf}", --ctx-size, "2048", --parallel, "1", --cache-ram, "0", --threads, "1"]'
    docs = "".join(
        model_doc(
            name,
            backend="llamacpp",
            extra=f"  args: {engine_args}\n  routing: {routing}\n  scaling: {{min: 2, max: 2}}\n",
        )
        for name, routing in MODELS.items()
    )
    rng = random.Random(5)
    systems = [" ".join(rng.choices(WORDS, k=450)) + f" (system {i})" for i in range(2)]
    order = [(rng.randrange(2), " ".join(rng.choices(WORDS, k=8))) for _ in range(args.requests)]
    up = UpProcess(tmp, docs)
    results: dict[str, Any] = {}
    try:
        up.wait_ready(dict.fromkeys(MODELS, 2), timeout=180)
        url = f"{up.url}/v1/chat/completions"
        for model in MODELS:
            endpoints = up.endpoints(model)
            before = {ep: metrics(ep) for ep in endpoints}
            ttft = [ask(url, model, systems[s], user) for s, user in order]
            after = {ep: metrics(ep) for ep in endpoints}

            def delta(name: str, ep: str) -> float:
                return after[ep].get(name, 0.0) - before[ep].get(name, 0.0)  # noqa: B023 - used in this loop only

            computed = sum(delta("llamacpp:prompt_tokens_total", ep) for ep in endpoints)
            cached = sum(delta("llamacpp:prompt_tokens_cached_total", ep) for ep in endpoints)
            results[model] = {
                "prompt_tokens_computed": computed,
                "prompt_tokens_cached": cached,
                "cached_share": round(cached / (cached + computed), 3) if cached + computed else None,
                "ttft_mean_s": round(statistics.fmean(ttft), 3),
            }
            print(json.dumps({model: results[model]}), flush=True)
    finally:
        up.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    out = {"loadavg": loadavg(), "git": git_state(), "requests": args.requests, "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
