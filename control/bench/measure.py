"""Measuring an OpenAI-compatible endpoint: streaming chat completions, time to first token, tokens/s.

Throughput is completion tokens of the successful requests over the run's wall time (what
the node delivers at that concurrency); TTFT is the median time to the first content chunk.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from rich.progress import Progress

#: the fixed prompt set: short and long, chat-like, the same on every run
PROMPTS = (
    "Explain in two sentences what a KV cache is.",
    "Write a haiku about GPUs waking up.",
    "List five prime numbers and say why each is prime.",
    "Summarise the plot of a heist movie in one paragraph.",
    "Translate 'the model is ready' into French, German and Spanish.",
    "Describe how a load balancer picks a backend, step by step, for a junior engineer.",
    "Write a short Python function that reverses a linked list, with comments.",
    "What are the trade-offs between throughput and latency when batching requests?",
)


@dataclass(frozen=True)
class Sample:
    ok: bool
    ttft_s: float = 0.0
    duration_s: float = 0.0
    tokens: int = 0
    error: str = ""


@dataclass(frozen=True)
class Summary:
    requests: int
    failures: int
    tokens: int
    wall_s: float
    tokens_per_second: float
    ttft_ms: float
    ttft_p90_ms: float
    first_error: str


def summarise(samples: list[Sample], wall_s: float) -> Summary:
    good = [s for s in samples if s.ok]
    tokens = sum(s.tokens for s in good)
    ttfts = sorted(s.ttft_s * 1000 for s in good)
    p90 = ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))] if ttfts else 0.0
    return Summary(
        requests=len(samples),
        failures=len(samples) - len(good),
        tokens=tokens,
        wall_s=wall_s,
        tokens_per_second=tokens / wall_s if wall_s > 0 and good else 0.0,
        ttft_ms=statistics.median(ttfts) if ttfts else 0.0,
        ttft_p90_ms=p90,
        first_error=next((s.error for s in samples if not s.ok), ""),
    )


def _chunk_text(event: dict[str, Any]) -> str:
    text = ""
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        text += str(delta.get("content") or "")
    return text


async def one_request(
    session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int
) -> Sample:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first: float | None = None
    chunks = 0
    usage_tokens: int | None = None
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                text = (await resp.text())[:200]
                return Sample(ok=False, error=f"HTTP {resp.status}: {text}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if _chunk_text(event):
                    chunks += 1
                    if first is None:
                        first = time.perf_counter()
                usage = event.get("usage")
                if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                    usage_tokens = usage["completion_tokens"]
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return Sample(ok=False, error=repr(exc))
    end = time.perf_counter()
    if first is None:
        return Sample(ok=False, error="no content in the stream")
    return Sample(
        ok=True, ttft_s=first - start, duration_s=end - start,
        tokens=usage_tokens if usage_tokens is not None else chunks,
    )


async def run_bench(
    base_url: str,
    model: str,
    *,
    requests: int,
    concurrency: int,
    max_tokens: int,
    api_key: str | None = None,
    timeout: float = 120.0,
    progress: Progress | None = None,
) -> Summary:
    url = base_url.rstrip("/") + "/chat/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    samples: list[Sample] = []
    task = progress.add_task("requests", total=requests) if progress is not None else None

    async def worker(session: aiohttp.ClientSession) -> None:
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            samples.append(await one_request(session, url, model, PROMPTS[i % len(PROMPTS)], max_tokens))
            if progress is not None and task is not None:
                progress.advance(task)

    limit = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(headers=headers, timeout=limit) as session:
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(max(1, concurrency))))
        wall = time.perf_counter() - start
    return summarise(samples, wall)
