"""Load, readiness, metrics under load, queueing, disconnects, crashes and SIGTERM."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

if TYPE_CHECKING:
    from tests.support.sim import SimFactory

_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)\{([^}]*)\} (\S+)$", re.M)


async def scrape(s: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """``name{labels}`` -> value, with the labels written as ``k=v,...`` minus model_name and engine."""
    async with s.get(f"{url}/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for name, labels, value in _SAMPLE.findall(text):
        kept = (p for p in labels.split(",") if p and not p.startswith(("model_name=", "engine=")))
        rest = ",".join(p.replace('"', "") for p in kept)
        out[f"{name}{{{rest}}}" if rest else name] = float(value)
    return out


async def until(
    s: aiohttp.ClientSession, url: str, ok: Callable[[dict[str, float]], bool], timeout: float = 3.0
) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = await scrape(s, url)
        if ok(m) or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.02)


async def open_stream(s: aiohttp.ClientSession, url: str, max_tokens: int) -> aiohttp.ClientResponse:
    """Start a streamed chat completion and wait for its first data line."""
    resp = await s.post(
        f"{url}/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "w1 w2 w3"}], "max_tokens": max_tokens,
              "stream": True},
    )  # fmt: skip
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    line = await resp.content.readline()
    assert line.startswith(b"data: {")
    return resp


async def test_health_503_while_loading(sim_factory: SimFactory) -> None:
    sim = sim_factory("--served-model-name", "m", "--startup-seconds", "0.8", wait_ready=False)
    assert sim.status("/health") == 503
    assert sim.status("/ping") == 503
    assert sim.status("/v1/models") == 503
    sim.wait_healthy(timeout=5)
    assert sim.status("/v1/models") == 200
    assert sim.status("/ping") == 200
    log = sim.log()
    assert "sim loading model=m" in log
    assert f"sim ready model=m url={sim.url}" in log


async def test_never_ready(sim_factory: SimFactory) -> None:
    sim = sim_factory("--never-ready", wait_ready=False)
    await asyncio.sleep(0.2)
    assert sim.status("/health") == 503


async def test_ttft_and_decode_rate(sim_factory: SimFactory) -> None:
    sim = sim_factory("--served-model-name", "m", "--ttft-ms", "250", "--tokens-per-second", "50")
    async with AsyncOpenAI(base_url=sim.base_url, api_key="x", max_retries=0) as c:
        t0 = time.monotonic()
        stream = await c.completions.create(model="m", prompt="p", max_tokens=6, stream=True)
        arrivals = [time.monotonic() - t0 async for ch in stream if ch.choices and ch.choices[0].text]
    assert len(arrivals) == 6
    assert 0.24 <= arrivals[0] < 1.0
    assert arrivals[-1] - arrivals[0] >= 5 / 50 * 0.9  # tokens spaced by 1/50 s, not buffered
    async with aiohttp.ClientSession() as s:
        m = await scrape(s, sim.url)
    assert m["vllm:time_to_first_token_seconds_count"] == 1
    assert m["vllm:time_to_first_token_seconds_sum"] >= 0.24


async def test_metrics_move_with_load_and_disconnect_frees_slots(sim_factory: SimFactory) -> None:
    sim = sim_factory("--served-model-name", "m", "--tokens-per-second", "20")
    async with aiohttp.ClientSession() as s:
        idle = await scrape(s, sim.url)
        assert idle["vllm:num_requests_running"] == 0 and idle["vllm:kv_cache_usage_perc"] == 0
        streams = [await open_stream(s, sim.url, max_tokens=200) for _ in range(3)]
        busy = await scrape(s, sim.url)
        assert busy["vllm:num_requests_running"] == 3
        assert busy["vllm:kv_cache_usage_perc"] > 0
        assert busy["vllm:prompt_tokens_total"] == 9
        assert busy["vllm:generation_tokens_total"] >= 3
        for resp in streams:
            resp.close()  # client goes away mid-stream
        after = await until(s, sim.url, lambda m: m["vllm:num_requests_running"] == 0)
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0
    assert after["vllm:request_success_total{finished_reason=abort}"] == 3
    assert after["vllm:generation_tokens_total"] < 3 * 200  # generation stopped


async def test_max_concurrency_queues_and_disconnect_frees_slot(sim_factory: SimFactory) -> None:
    sim = sim_factory("--served-model-name", "m", "--tokens-per-second", "20", "--max-concurrency", "1")
    async with aiohttp.ClientSession() as s, AsyncOpenAI(base_url=sim.base_url, api_key="x") as c:
        holder = await open_stream(s, sim.url, max_tokens=200)
        queued = asyncio.create_task(
            c.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}], max_tokens=2)
        )
        m = await until(s, sim.url, lambda m: m["vllm:num_requests_waiting"] == 1)
        assert m["vllm:num_requests_waiting"] == 1 and m["vllm:num_requests_running"] == 1
        assert not queued.done()
        holder.close()
        r = await asyncio.wait_for(queued, timeout=3)
        assert r.choices[0].message.content == "the quick"
        m = await until(s, sim.url, lambda m: m["vllm:num_requests_running"] == 0)
    assert m["vllm:num_requests_waiting"] == 0 and m["vllm:num_requests_running"] == 0


async def test_api_key(sim_factory: SimFactory) -> None:
    sim = sim_factory("--served-model-name", "m", "--api-key", "s3cret")
    assert sim.status("/health") == 200  # health needs no key
    async with AsyncOpenAI(base_url=sim.base_url, api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            await c.models.list()
    async with AsyncOpenAI(base_url=sim.base_url, api_key="s3cret", max_retries=0) as c:
        assert [m.id for m in (await c.models.list()).data] == ["m"]


async def test_fail_after_seconds_exits_with_code(sim_factory: SimFactory) -> None:
    sim = sim_factory("--fail-after-seconds", "0.3", "--exit-code", "137")
    assert await asyncio.to_thread(sim.wait, 5) == 137
    assert "sim failing exit_code=137" in sim.log()


async def test_sigterm_finishes_in_flight_stream_then_exits_0(sim_factory: SimFactory) -> None:
    sim = sim_factory("--served-model-name", "m", "--tokens-per-second", "20")
    async with aiohttp.ClientSession() as s:
        resp = await open_stream(s, sim.url, max_tokens=12)  # ~0.55 s of decoding left
        sim.signal(signal.SIGTERM)
        # new connections are refused while the stream goes on
        deadline = time.monotonic() + 2
        while sim.status("/health", timeout=0.2) is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert sim.status("/health", timeout=0.2) is None
        body = (await resp.content.read()).decode()
        resp.close()
    assert body.count('"content":') == 12  # all 12 tokens (readline took the role chunk)
    assert body.endswith("data: [DONE]\n\n")
    assert await asyncio.to_thread(sim.wait, 5) == 0
    log = sim.log()
    assert "sim draining" in log and "sim stopped" in log


async def test_sigterm_drain_is_bounded(sim_factory: SimFactory) -> None:
    sim = sim_factory("--served-model-name", "m", "--tokens-per-second", "20", "--drain-seconds", "0.3")
    async with aiohttp.ClientSession() as s:
        resp = await open_stream(s, sim.url, max_tokens=400)  # 20 s of decoding
        t0 = time.monotonic()
        sim.signal(signal.SIGTERM)
        assert await asyncio.to_thread(sim.wait, 5) == 0
        assert time.monotonic() - t0 < 3
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.content.read()  # the stream was cut, not completed
        resp.close()
    assert "sim drain timed out: cancelled 1" in sim.log()
