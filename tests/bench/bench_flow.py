"""Flow control under overload: a quiet tenant beside a flooding one, weighted shares, priority bands.

Run from the repository root (not collected by `pytest tests`):

    python -m tests.bench.bench_flow [--seconds 15] [--rate 1.5] [--json OUT]

It starts one `wakegate up` (real Envoy, two extprocs) with two identical sim models, each on
its own replica that saturates like a small GPU server: 16 requests decode at once (more wait in
the engine, first come first served), 250 ms to the first token, 30 tokens/s, each running
request slowing the batch by 2%; a request asks for 16 tokens (about 1 s at full batch; ~16
requests/s per replica). `fc-on` has flow control (saturated at 1 request waiting in the engine, 50 held), `fc-off`
has none. Every request streams, and TTFT is the time to its first token. Clients send open-loop
(a fixed rate, whatever the answers), so an overloaded model cannot slow its own load down.

Phases, one after the other (one model at a time: the two never compete for the CPUs):

1. `alone`: the quiet tenant alone at `--rate` requests/s (its TTFT alone, unloaded);
2. `noisy-on` / `noisy-off`: the quiet tenant at `--rate` beside a loud tenant at 10x that rate
   (past saturation), equal weights: the quiet tenant's p90 TTFT against its TTFT alone, and
   what share of each tenant's requests was served;
3. `weights-on`: two tenants, both flooding at 10x `--rate`, weights 1 and 3: their shares of
   the served requests against 25% / 75%;
4. `priority-on` / `priority-off`: critical traffic at `--rate` beside sheddable traffic at 10x:
   critical p90 TTFT against `alone`, and which band was refused.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from tests.bench.common import git_state, loadavg
from tests.support.up import UpProcess, model_doc

SIM_ARGS = (
    '[--max-concurrency, "16", --ttft-ms, "250", --tokens-per-second, "30", --batch-slowdown, "0.02", '
    '--max-tokens-default, "16"]'
)
FLEET = model_doc(
    "fc-on",
    extra=f"""  args: {SIM_ARGS}
  scaling: {{min: 1, max: 1}}
  flowControl: {{enabled: true, maxQueue: 50, queueTimeout: 30, saturation: {{maxWaiting: 1}}}}
""",
) + model_doc("fc-off", extra=f"  args: {SIM_ARGS}\n  scaling: {{min: 1, max: 1}}\n")
KEYS = {
    "quiet": "sk-bench-quiet-0123456789",
    "loud": "sk-bench-loud-0123456789",
    "w1": "sk-bench-w1-0123456789",
    "w3": "sk-bench-w3-0123456789",
    "crit": "sk-bench-crit-0123456789",
    "bulk": "sk-bench-bulk-0123456789",
}
KEYS_TEXT = (
    f"{KEYS['quiet']} tenant=quiet\n{KEYS['loud']} tenant=loud\n{KEYS['w1']} tenant=w1 weight=1\n"
    f"{KEYS['w3']} tenant=w3 weight=3\n{KEYS['crit']} tenant=crit band=critical\n"
    f"{KEYS['bulk']} tenant=bulk band=sheddable\n"
)


@dataclass
class Stream:
    """One client's results in one phase."""

    sent: int = 0
    ok: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    ttft: list[float] = field(default_factory=list)

    def p(self, q: float) -> float | None:
        if len(self.ttft) < 2:
            return None
        return statistics.quantiles(self.ttft, n=100)[int(q) - 1]

    def summary(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "served": self.ok,
            "refused": self.refused,
            "ttft_p50_ms": _ms(self.p(50)),
            "ttft_p90_ms": _ms(self.p(90)),
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


async def one(session: aiohttp.ClientSession, url: str, model: str, key: str, out: Stream) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "hello there"}], "stream": True}
    started = time.monotonic()
    out.sent += 1
    try:
        async with session.post(url, json=body, headers={"authorization": f"Bearer {key}"}) as resp:
            if resp.status != 200:
                code = (await resp.json(content_type=None)).get("error", {}).get("code", str(resp.status))
                out.refused[f"{resp.status} {code}"] = out.refused.get(f"{resp.status} {code}", 0) + 1
                return
            first = True
            async for _chunk in resp.content.iter_any():
                if first:
                    out.ttft.append(time.monotonic() - started)
                    first = False
            out.ok += 1
    except (aiohttp.ClientError, TimeoutError) as exc:
        out.refused[type(exc).__name__] = out.refused.get(type(exc).__name__, 0) + 1


async def client(
    session: aiohttp.ClientSession, url: str, model: str, key: str, rate: float, seconds: float, out: Stream
) -> None:
    """Open loop: one request every 1/rate seconds for `seconds`, whatever the answers."""
    tasks = []
    start = time.monotonic()
    n = 0
    while (due := start + n / rate) < start + seconds:
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        tasks.append(asyncio.create_task(one(session, url, model, key, out)))
        n += 1
    await asyncio.gather(*tasks)


async def phase(url: str, model: str, seconds: float, streams: dict[str, tuple[str, float]]) -> dict[str, Stream]:
    """Run the named clients (key name -> (key, rate)) together against `model`."""
    out = {name: Stream() for name in streams}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(
            *(client(session, url, model, key, rate, seconds, out[name]) for name, (key, rate) in streams.items())
        )
    await asyncio.sleep(2)  # the engine's queue drains before the next phase
    return out


async def run(up: UpProcess, seconds: float, rate: float) -> dict[str, dict[str, Any]]:
    url = f"{up.url}/v1/chat/completions"
    loud = rate * 10
    plan: list[tuple[str, str, dict[str, tuple[str, float]]]] = [
        ("warmup", "fc-on", {"quiet": (KEYS["quiet"], loud)}),  # the engine queues once: its cap is learnt
        ("alone", "fc-on", {"quiet": (KEYS["quiet"], rate)}),
        ("noisy-on", "fc-on", {"quiet": (KEYS["quiet"], rate), "loud": (KEYS["loud"], loud)}),
        ("noisy-off", "fc-off", {"quiet": (KEYS["quiet"], rate), "loud": (KEYS["loud"], loud)}),
        ("weights-on", "fc-on", {"w1": (KEYS["w1"], loud), "w3": (KEYS["w3"], loud)}),
        ("priority-on", "fc-on", {"critical": (KEYS["crit"], rate), "sheddable": (KEYS["bulk"], loud)}),
        ("priority-off", "fc-off", {"critical": (KEYS["crit"], rate), "sheddable": (KEYS["bulk"], loud)}),
    ]
    results: dict[str, dict[str, Any]] = {}
    for name, model, streams in plan:
        done = await phase(url, model, 4 if name == "warmup" else seconds, streams)
        results[name] = {who: s.summary() for who, s in done.items()}
        print(f"{name:13} {model:7} " + "  ".join(f"{who}: {json.dumps(s.summary())}" for who, s in done.items()))
    return results


def verdict(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    alone = results["alone"]["quiet"]["ttft_p90_ms"]
    w = results["weights-on"]
    served = w["w1"]["served"] + w["w3"]["served"]
    return {
        "quiet_p90_ratio_on": round(results["noisy-on"]["quiet"]["ttft_p90_ms"] / alone, 2),
        "quiet_p90_ratio_off": round(results["noisy-off"]["quiet"]["ttft_p90_ms"] / alone, 2),
        "quiet_served_on": f"{results['noisy-on']['quiet']['served']}/{results['noisy-on']['quiet']['sent']}",
        "weights_share_w1_w3": [round(w["w1"]["served"] / served, 3), round(w["w3"]["served"] / served, 3)],
        "critical_p90_ratio_on": round(results["priority-on"]["critical"]["ttft_p90_ms"] / alone, 2),
        "critical_p90_ratio_off": round(results["priority-off"]["critical"]["ttft_p90_ms"] / alone, 2),
        "refused_on": {band: results["priority-on"][band]["refused"] for band in ("critical", "sheddable")},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=15.0, help="seconds each phase sends (default 15)")
    ap.add_argument("--rate", type=float, default=2.0, help="the quiet tenant's requests/s (default 2)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here as JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-flow-") as tmp_dir:
        tmp = Path(tmp_dir)
        (tmp / "keys.txt").write_text(KEYS_TEXT)
        load_before = loadavg()
        up = UpProcess(tmp, FLEET, "--api-keys-file", str(tmp / "keys.txt"))
        try:
            up.wait_ready({"fc-on": 1, "fc-off": 1})
            results = asyncio.run(run(up, args.seconds, args.rate))
        finally:
            up.stop()
    summary = verdict(results)
    print(json.dumps(summary, indent=2))
    print(f"load average before {load_before}, after {loadavg()}")
    if args.json is not None:
        record = {"phases": results, "verdict": summary, "git": git_state(), "args": vars(args)}
        args.json.write_text(json.dumps(record, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
