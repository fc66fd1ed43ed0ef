"""`wakegate savings`, the model dashboard's savings panels and the metrics agree: a real Prometheus
scrapes a `wakegate up` whose model goes warm -> asleep -> zero and is woken from both; over the
window between two of its scrapes, the raw counter samples, the panels' queries (as Grafana sends
them, `$__range` the window) and `wakegate savings --since --until` give the same numbers."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dashboards.definitions import MODEL
from dashboards.grafana import expand
from tests.support.http import request
from tests.support.prometheus import MISSING, Prometheus, available
from tests.support.up import UpProcess, model_doc

pytestmark = pytest.mark.skipif(not available(), reason=MISSING)

#: Counters and wake stamps are taken a few milliseconds apart by a scrape; the CLI's table rounds to 0.1 s.
SLACK = 0.05


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[UpProcess, Prometheus]]:
    doc = model_doc(
        "m",
        extra="""  args: [--wake-seconds, "0.05"]
  scaling: {min: 0, max: 1, sleepAfter: 1, idleTimeout: 3, activationTimeout: 30}
""",
    )
    up = UpProcess(tmp_path, doc)
    prom: Prometheus | None = None
    try:
        up.wait_ready({}, timeout=60)
        prom = Prometheus(
            tmp_path, [{"job_name": "up", "static_configs": [{"targets": [f"127.0.0.1:{up.admin_port}"]}]}]
        )
        prom.wait_ready()
        yield up, prom
    finally:
        if prom is not None:
            prom.stop()
        assert up.stop() == 0, up.log()


def ask(up: UpProcess) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert request("POST", f"{up.base_url}/chat/completions", body=body, timeout=60).status == 200


def tier(up: UpProcess) -> str:
    return str(up.status()["models"][0]["tier"])


def wait_tier(up: UpProcess, wanted: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while tier(up) != wanted:
        assert time.monotonic() < deadline, f"never {wanted}: {up.status()['models'][0]}"
        time.sleep(0.1)


def samples(prom: Prometheus, series: str, label: str) -> dict[str, list[tuple[float, float]]]:
    """label value -> (timestamp, value) of every scrape of `series` in the last 5 minutes."""
    answer = prom.api("query", query=f'{series}{{model="m"}}[5m]')
    return {
        r["metric"][label]: [(float(t), float(v)) for t, v in r["values"]] for r in answer["data"]["result"]
    }


def panel(prom: Prometheus, title: str, legend: str, at: float, range_ms: int) -> dict[str, float]:
    target = next(t for p in MODEL.panels if p.title == title for t in p.targets if t.legend.startswith(legend))
    expr = expand(target.expr, model="m", range_=f"{range_ms}ms")
    answer = prom.api("query", query=expr, time=f"{at:.3f}")
    return {r["metric"]["tier"]: float(r["value"][1]) for r in answer["data"]["result"]}


def cli(up: UpProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "wakegate", "savings", "--admin", f"127.0.0.1:{up.admin_port}", *args],
        capture_output=True, text=True, timeout=30, check=False,
    )


def test_cli_panels_and_metrics_agree(stack: tuple[UpProcess, Prometheus]) -> None:
    up, prom = stack
    deadline = time.monotonic() + 30
    while not samples(prom, "wakegate_accelerator_seconds_total", "tier"):  # scraped at zero first
        assert time.monotonic() < deadline, prom.log_path.read_text()
        time.sleep(0.2)
    ask(up)  # a wake from zero
    wait_tier(up, "asleep")
    ask(up)  # a wake from asleep
    wait_tier(up, "zero")
    time.sleep(2)
    seconds = samples(prom, "wakegate_accelerator_seconds_total", "tier")
    t1 = seconds["zero"][0][0]
    t2 = seconds["zero"][-1][0]
    range_ms = round((t2 - t1) * 1000)
    # The counters over [t1, t2], as scraped.
    scraped = {tier: dict(points)[t2] - dict(points).get(t1, 0.0) for tier, points in seconds.items()}
    assert scraped["warm"] > 0 and scraped["asleep"] > 0 and scraped["zero"] > 0, scraped

    shown = panel(prom, "Savings: accelerator-seconds by tier", "{{tier}}", t2, range_ms)
    result = cli(up, "--since", repr(t1), "--until", repr(t2), "--json")
    assert result.returncode == 0, result.stderr
    answer: dict[str, Any] = json.loads(result.stdout)["models"]["m"]
    for name, value in scraped.items():
        assert shown[name] == pytest.approx(value, abs=1e-6), (name, shown, scraped)
        assert answer["accelerator_seconds"][name] == pytest.approx(value, abs=SLACK), (name, answer, scraped)

    # Both wakes came after t1: their series began within the window.
    counts = {k: dict(v)[t2] for k, v in samples(prom, "wakegate_wake_seconds_count", "tier").items()}
    waited = {k: dict(v)[t2] for k, v in samples(prom, "wakegate_wake_seconds_sum", "tier").items()}
    assert counts == {"zero": 1.0, "asleep": 1.0}
    assert panel(prom, "Wakes by tier and their waiting", "wakes", t2, range_ms) == counts
    assert panel(prom, "Wakes by tier and their waiting", "waited", t2, range_ms) == pytest.approx(waited)
    for name in ("zero", "asleep"):
        assert answer["wakes"][name]["count"] == counts[name]
        assert answer["wakes"][name]["wait_seconds"] == pytest.approx(waited[name], abs=1e-6)

    # The table shows the same, rounded.
    table = cli(up, "--since", repr(t1), "--until", repr(t2))
    assert table.returncode == 0, table.stderr
    row = next(line.split() for line in table.stdout.splitlines() if line.startswith("m "))
    assert [float(x) for x in row[1:4]] == pytest.approx(
        [scraped["warm"], scraped["asleep"], scraped["zero"]], abs=0.05 + SLACK
    )
    assert row[5:] == ["1", f"{waited['asleep']:.2f}s", "1", f"{waited['zero']:.2f}s"]

    # Bad input: one line on stderr, status 1.
    result = cli(up, "--since", "10", "--until", "5")
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "since is after until" in result.stderr
    result = subprocess.run([sys.executable, "-m", "wakegate", "savings", "--admin", "127.0.0.1:1"],
                            capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 1 and "cannot read" in result.stderr and "Traceback" not in result.stderr
