"""Between warm and zero: what the asleep tier and predictive wake buy, side by side in one run.

    nice -n 10 .venv/bin/python -m tests.bench.bench_sleep [--scenario ollama,swap,predict]
        [--rounds 5] [--days 5] [--json OUT]

``ollama``  Real Ollama (the cached build) on the generated tiny GGUF, two Models of the same file
            under one `wakegate up`: `sleepy` idles to asleep after 1 s (the model unloaded from
            the running `ollama serve`), `zeroed` to zero after 2 s (the process stopped). Each
            round asks both once warm, lets them idle, then asks again: the added latency of the
            request that woke each (its time less the warm one's), per tier.
``swap``    The sim with vLLM's sleep API (`--enable-sleep-mode`; load 4 s, wake 0.3 s, 50 ms to
            the first token, 100 tokens/s), two GPU groups of two models each in one `up`: one
            whose members sleep on a swap, one whose members stop. Six prompts alternate between
            a group's two models (a, b, a, b, a, b; 32 tokens each, streamed): total time, each
            prompt's time to first token, and the swap anatomy from `up`'s log: detect (prompt
            sent -> the group turned), terminate (-> the outgoing model stopped or asleep), load
            (-> the incoming model ready or awake), first inference (-> its first token).
``predict`` A compressed daily trace (a day of `--period` s, sessions of two requests starting at
            the same times each day, ±0.3 s jitter, seeded) replayed to two sim models in one
            `up` (load 2 s, idleTimeout 2 s): `pred` with predictive wake (lead `--lead` s, budget 60 s a
            day), `react` without. Reported: the share of first requests that found the model
            warm, predictive wakes by outcome, the speculative accelerator-seconds spent, and each
            model's accelerator-seconds warm over the run (from `/savings`).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp

from tests.bench.common import git_state, loadavg
from tests.support.http import request
from tests.support.up import UpProcess, model_doc

LOG_LINE = re.compile(r"^(\S+ \S+) INFO wakegate.up (.*)$")


def ask(up: UpProcess, model: str, tokens: int = 2) -> float:
    started = time.monotonic()
    body = {"model": model, "messages": [{"role": "user", "content": "tell me about the weather"}],
            "max_tokens": tokens, "temperature": 0}
    response = request("POST", f"{up.base_url}/chat/completions", body=body, timeout=300)
    assert response.status == 200, response.body
    return time.monotonic() - started


def model_status(up: UpProcess, key: str) -> dict[str, Any]:
    return next(m for m in up.status()["models"] if m["key"] == key)


def wait_tier(up: UpProcess, key: str, tier: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while model_status(up, key)["tier"] != tier:
        if time.monotonic() > deadline:
            raise AssertionError(f"{key} never {tier}")
        time.sleep(0.05)


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"mean": round(statistics.fmean(ordered), 3), "p50": round(ordered[len(ordered) // 2], 3),
            "min": round(ordered[0], 3), "max": round(ordered[-1], 3)}


# -- ollama ---------------------------------------------------------------------------------------


def run_ollama(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from e2e import engines
    from e2e.tinymodel import ModelSpec, write_model
    from tests.engines.test_up_engines import engines_path
    from tests.engines.test_up_ollama_sleep import FLEET

    ollama = engines.ensure("ollama")
    (tmp / "weights").mkdir()
    write_model(tmp / "weights" / "tiny.gguf", ModelSpec(seed=0))
    up = UpProcess(tmp, FLEET, env=engines_path(ollama))
    added: dict[str, list[float]] = {"asleep": [], "zero": []}
    try:
        up.wait_ready({}, timeout=120)
        for _ in range(args.rounds):
            warm = {}
            for key in ("sleepy", "zeroed"):
                ask(up, key)
                warm[key] = min(ask(up, key) for _ in range(3))
            wait_tier(up, "sleepy", "asleep")
            wait_tier(up, "zeroed", "zero")
            added["asleep"].append(ask(up, "sleepy") - warm["sleepy"])
            added["zero"].append(ask(up, "zeroed") - warm["zeroed"])
            print(f"ollama round: asleep +{added['asleep'][-1]:.3f}s  zero +{added['zero'][-1]:.3f}s", flush=True)
        pid = model_status(up, "sleepy")["replicas"][0]["pid"]
    finally:
        up.stop()
    return {"scenario": "ollama", "added_latency_s": {k: summary(v) for k, v in added.items()},
            "sleepy_pid_kept": pid, "rounds": args.rounds}


# -- swap -----------------------------------------------------------------------------------------

SIM_ARGS = '[--startup-seconds, "4", --wake-seconds, "0.3", --ttft-ms, "50", --tokens-per-second, "100"]'


def group_doc(name: str, group: str, sleep: bool) -> str:
    tiers = "sleepAfter: 300, " if sleep else ""
    return model_doc(name, extra=f"""  args: {SIM_ARGS}
  scaling: {{min: 0, max: 1, {tiers}idleTimeout: 600, activationTimeout: 120}}
  gpu: {{shared: {group}, minRunSeconds: 0, swapCooldownSeconds: 0, demandWindowSeconds: 0}}
""")


async def stream(session: aiohttp.ClientSession, up: UpProcess, model: str) -> tuple[float, float, float]:
    """(sent at, first token at, done at), wall clock."""
    body = {"model": model, "messages": [{"role": "user", "content": "go"}], "max_tokens": 32, "stream": True}
    sent = time.time()
    first = 0.0
    async with session.post(f"{up.base_url}/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if not first and b'"content":"' in line and b'"content":""' not in line:
                first = time.time()
    return sent, first, time.time()


def log_events(up: UpProcess) -> list[tuple[float, str]]:
    out = []
    for line in up.log().splitlines():
        found = LOG_LINE.match(line)
        if found:
            stamp = dt.datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((stamp, found.group(2)))
    return out


def after(events: list[tuple[float, str]], since: float, pattern: str) -> float | None:
    return next((t for t, text in events if t >= since - 0.01 and re.search(pattern, text)), None)


def anatomy(events: list[tuple[float, str]], group: str, model: str, other: str | None, sent: float,
            first: float) -> dict[str, float | None]:
    turn = after(events, sent, rf"gpu group turn group={group} from=\S+ to={model}$")
    gone = after(events, sent, rf"replica (stopped|asleep) model={other} ") if other else None
    ready = after(events, sent, rf"replica (ready|awake) model={model} ")

    def since(t: float | None, base: float | None) -> float | None:
        return None if t is None or base is None else round(t - base, 3)

    return {"detect": since(turn, sent), "terminate": since(gone, turn), "load": since(ready, gone or turn),
            "first_inference": since(first, ready)}


async def alternate(up: UpProcess, group: str, a: str, b: str) -> dict[str, Any]:
    prompts = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        began = time.time()
        for i, model in enumerate((a, b) * 3):
            sent, first, done = await stream(session, up, model)
            prompts.append({"model": model, "sent": sent, "first": first, "ttft": round(first - sent, 3),
                            "total": round(done - sent, 3), "other": (b if model == a else a) if i else None})
        total = time.time() - began
    await asyncio.sleep(0.5)  # the log lines of the last wake
    events = log_events(up)
    for p in prompts:
        p["anatomy"] = anatomy(events, group, p["model"], p.pop("other"), p.pop("sent"), p.pop("first"))
    return {"total_s": round(total, 3), "prompts": prompts}


def run_swap(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    docs = group_doc("a1", "sleepy", True) + group_doc("a2", "sleepy", True)
    docs += group_doc("b1", "stoppy", False) + group_doc("b2", "stoppy", False)
    up = UpProcess(tmp, docs)
    try:
        up.wait_ready({}, timeout=120)
        sleep = asyncio.run(alternate(up, "sleepy", "a1", "a2"))
        stop = asyncio.run(alternate(up, "stoppy", "b1", "b2"))
    finally:
        up.stop()
    return {"scenario": "swap", "sleep": sleep, "stop_start": stop}


# -- predict --------------------------------------------------------------------------------------


def pred_doc(name: str, predictive: bool, period: float, lead: float) -> str:
    extra = "  args: [--startup-seconds, \"2\"]\n  scaling: {min: 0, max: 1, idleTimeout: 2, activationTimeout: 60"
    if predictive:
        extra += f", predictive: {{enabled: true, leadSeconds: {lead:g}, periodSeconds: {period:g}, budgetSeconds: 60}}"
    return model_doc(name, extra=extra + "}\n")


def run_predict(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    period = args.period
    rng = random.Random(7)
    phases = (3.0, period / 2 + 2.0)
    up = UpProcess(tmp, pred_doc("pred", True, period, args.lead) + pred_doc("react", False, period, args.lead))
    try:
        up.wait_ready({}, timeout=120)
        start = time.time() + 1
        trace = sorted(start + day * period + phase + rng.uniform(-0.3, 0.3)
                       for day in range(args.days) for phase in phases)
        def replay(model: str) -> None:
            """The trace to one model, on its own: each session two requests 0.5 s apart."""
            for at in trace:
                time.sleep(max(0.0, at - time.time()))
                ask(up, model)
                time.sleep(0.5)
                ask(up, model)

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(replay, ("pred", "react")))
        time.sleep(3)
        status = {m["key"]: m for m in up.status()["models"]}
        savings = request("GET", f"http://127.0.0.1:{up.admin_port}/savings?since={start!r}").json()["models"]
    finally:
        up.stop()
    out: dict[str, Any] = {"scenario": "predict", "period_s": period, "days": args.days, "sessions": len(trace)}
    for key in ("pred", "react"):
        p = status[key]["predictive"]
        found = p["first_requests"]
        out[key] = {
            "first_requests_found_warm": found["found_warm"],
            "first_requests": found["found_warm"] + found["found_cold"],
            "warm_share": round(found["found_warm"] / max(1, found["found_warm"] + found["found_cold"]), 3),
            "warm_accelerator_s": round(savings[key]["accelerator_seconds"]["warm"], 1),
            "zero_wakes": savings[key]["wakes"]["zero"]["count"],
            "zero_wake_wait_s": round(savings[key]["wakes"]["zero"]["wait_seconds"], 2),
            **({k: p[k] for k in ("hits", "late", "misses", "wasted_seconds", "spent_seconds_total")}
               if p["enabled"] else {}),
        }
    return out


SCENARIOS = {"ollama": run_ollama, "swap": run_swap, "predict": run_predict}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="ollama,swap,predict")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--days", type=int, default=5)
    parser.add_argument("--period", type=float, default=20.0)
    parser.add_argument("--lead", type=float, default=6.0, help="predict: leadSeconds (above a cold start here)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    results = []
    for name in args.scenario.split(","):
        tmp = Path(tempfile.mkdtemp(prefix=f"bench-sleep-{name}-"))
        try:
            results.append(SCENARIOS[name](args, tmp))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"args": vars(args), "loadavg": loadavg(), "git": git_state(), "results": results}, out,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
