"""What reading an engine's /metrics costs extproc: `extproc.engines.parse` (over the shared
reader `wakegate.promtext`) beside the hand-written scan it replaced and prometheus_client's parser.

Run from the repository root (not collected by `pytest tests`):

    python -m tests.bench.bench_promtext [--rounds 7] [--json OUT]

The exposition is vLLM-sized and vLLM-shaped (the series extproc reads, twelve histograms of
twenty buckets, LoRA gauges: ~380 lines, ~25 KB). The three readers run round by round in one
process, so they see the same machine load; the table is each one's best round in microseconds
per exposition. extproc reads each engine twice a second on the event loop that serves requests,
so this is CPU taken from requests.
"""

from __future__ import annotations

import argparse
import json
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.bench.common import git_state, loadavg
from wakegate import contract
from wakegate.extproc import engines

BUCKETS = [0.001 * 2**i for i in range(19)]


def exposition() -> str:
    lines: list[str] = []
    labels = 'engine="0",model_name="m"'
    for name, value in ((contract.VLLM_RUNNING, 3), (contract.VLLM_WAITING, 1), (contract.VLLM_KV_USAGE, 0.42)):
        lines += [f"# HELP {name} x", f"# TYPE {name} gauge", f"{name}{{{labels}}} {float(value)}"]
    for i in range(3):
        lines.append(f'{contract.VLLM_LORA_INFO}{{max_lora="4",running_lora_adapters="a{i}",'
                     f'waiting_lora_adapters=""}} {1.7e9 + i}')
    for h in range(12):
        name = f"vllm:histogram_{h}_seconds"
        lines += [f"# HELP {name} x", f"# TYPE {name} histogram"]
        lines += [f'{name}_bucket{{{labels},le="{b}"}} {float(i)}' for i, b in enumerate(BUCKETS)]
        lines += [f'{name}_bucket{{{labels},le="+Inf"}} 20.0', f"{name}_count{{{labels}}} 20.0",
                  f"{name}_sum{{{labels}}} 1.5", f"{name}_created{{{labels}}} 1.7e9"]
    return "\n".join(lines) + "\n"


def handwritten(text: str) -> tuple[dict[str, float], list[str]]:
    """The scan extproc had before the shared reader (what it looked at, without the state)."""
    names = {contract.VLLM_RUNNING, contract.VLLM_WAITING, contract.VLLM_KV_USAGE}
    found: dict[str, float] = {}
    lora_lines: list[str] = []
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if space < 0:
            continue
        name = line[: brace if 0 <= brace < space else space]
        if name not in names:
            if name == contract.VLLM_LORA_INFO and brace > 0:
                lora_lines.append(line)
            continue
        try:
            value = float(line.rsplit(" ", 1)[1] if brace < 0 else line[line.rindex("}") + 1 :].split()[0])
        except (ValueError, IndexError):
            continue
        found[name] = found.get(name, 0.0) + value
    return found, lora_lines


def prometheus_client(text: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[sample.name] = found.get(sample.name, 0.0) + sample.value
    return found


def per_call_us(read: Callable[[str], Any], text: str) -> float:
    """Microseconds per call, timed over enough calls to last at least 0.2 s."""
    calls, seconds = timeit.Timer(lambda: read(text)).autorange()
    return seconds / calls * 1e6


def measure(text: str, rounds: int) -> dict[str, float]:
    """Each reader's best round, the readers taking turns round by round."""
    readers = {"engines.parse (promtext)": engines.parse, "hand-written scan (before)": handwritten,
               "prometheus_client parser": prometheus_client}
    times: dict[str, list[float]] = {name: [] for name in readers}
    for _ in range(rounds):
        for name, read in readers.items():
            times[name].append(per_call_us(read, text))
    return {name: round(min(each), 1) for name, each in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    text = exposition()
    state = engines.parse(text)
    assert state is not None and (state.running, state.adapters) == (3.0, frozenset({"a2"}))
    results = measure(text, args.rounds)
    lines = [f"exposition: {len(text.splitlines())} lines, {len(text)} bytes"]
    lines += [f"{name:>28} {best:>9} us" for name, best in results.items()]
    print("\n".join([*lines, f"load average at the end: {loadavg()}"]))
    if args.json is not None:
        record = {"git": git_state(), "lines": len(text.splitlines()), "results": results}
        args.json.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
