"""`wakegate bench` against a real `wakegate sim`: throughput, TTFT, failures, the result key."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.support.sim import REPO_ROOT, SimProcess, start_sim
from wakegate.control.bench.measure import PROMPTS, Sample, run_bench, summarise
from wakegate.control.placement.benchdata import BenchResult, result_key, throughput_table


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    # 200 tokens/s per request, 50 ms to the first token, 16 tokens per answer
    proc = start_sim(
        0,
        "--served-model-name",
        "m1",
        "--tokens-per-second",
        "200",
        "--ttft-ms",
        "50",
        "--max-tokens-default",
        "16",
        "--drain-seconds",
        "0",
    )
    yield proc
    proc.stop()


async def test_throughput_and_ttft_of_a_sim(sim: SimProcess) -> None:
    summary = await run_bench(sim.base_url, "m1", requests=8, concurrency=4, max_tokens=20)
    assert summary.failures == 0 and summary.requests == 8
    assert summary.tokens == 8 * 20
    # 4 streams at 200 tokens/s each, less the TTFT and overheads
    assert 300 < summary.tokens_per_second < 800
    assert 45 <= summary.ttft_ms < 500


async def test_unknown_model_fails_every_request(sim: SimProcess) -> None:
    summary = await run_bench(sim.base_url, "nope", requests=2, concurrency=2, max_tokens=4)
    assert summary.failures == 2 and summary.tokens_per_second == 0
    assert summary.first_error.startswith("HTTP 404")


async def test_nothing_listening() -> None:
    summary = await run_bench("http://127.0.0.1:9/v1", "m1", requests=1, concurrency=1, max_tokens=4, timeout=5)
    assert summary.failures == 1 and "Connect" in summary.first_error


def test_cli_prints_a_summary(sim: SimProcess) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wakegate",
            "bench",
            "--url",
            sim.base_url,
            "--model",
            "m1",
            "--requests",
            "4",
            "--concurrency",
            "2",
            "--max-tokens",
            "8",
            "--json",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["requests"] == 4 and summary["failures"] == 0 and summary["tokens"] == 32
    assert "tokens/s" in proc.stderr and "4/4" in proc.stderr


def test_cli_refuses_device_class_without_backend() -> None:
    from wakegate.cli import main

    assert main(["bench", "--url", "http://x/v1", "--model", "m", "--device-class", "nvidia-sm90"]) == 2


def test_summary_edges() -> None:
    empty = summarise([], 0.0)
    assert empty.tokens_per_second == 0 and empty.ttft_ms == 0
    mixed = summarise([Sample(ok=True, ttft_s=0.1, tokens=10), Sample(ok=False, error="x")], 2.0)
    assert mixed.tokens_per_second == 5 and mixed.failures == 1 and mixed.first_error == "x"
    assert len(PROMPTS) == 8


def test_result_key_and_table() -> None:
    result = BenchResult("vllm", "m1", "nvidia-sm90", 123.4, 56.0, "2026-01-01T00:00:00Z")
    assert result.key == result_key("vllm", "m1", "nvidia-sm90")
    assert result.key == hashlib.sha256(b"vllm|m1|nvidia-sm90").hexdigest()
    table = throughput_table(
        {
            result.key: result.to_json(),
            "bad": "{",
            "nan": '{"tokens_per_second": NaN}',
            "list": "[]",
            "neg": '{"tokens_per_second": -1}',
        }
    )
    assert table == {result.key: 123.4}
    assert throughput_table(None) == {}
