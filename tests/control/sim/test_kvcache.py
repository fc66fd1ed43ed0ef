"""The sim's prefix cache against numbers worked out by hand, then through a running sim."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import aiohttp
from openai import AsyncOpenAI

from tests.control.sim.test_lifecycle import scrape
from wakegate.control.sim.kvcache import ROOT, KVCache, block_hashes

if TYPE_CHECKING:
    from tests.support.sim import SimFactory


def words(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def test_block_hashes_chain_full_blocks_only() -> None:
    a = words("a", 40)  # 2 full blocks + 8 tokens
    ha = block_hashes(a)
    assert len(ha) == 2
    # the second block's tokens alone do not name it: its parent is part of the hash
    b = words("b", 16) + a[16:32]
    hb = block_hashes(b)
    assert hb[1] != ha[1]
    assert block_hashes(a[16:32], ha[0]) == [ha[1]]  # continuing a chain from its parent
    assert block_hashes(a[:15]) == []
    assert block_hashes(a, ROOT) == ha == block_hashes(list(a))  # deterministic


def test_hits_eviction_order_and_capacity_by_hand() -> None:
    stored: list[list[bytes]] = []
    removed: list[list[bytes]] = []
    kv = KVCache(4, on_stored=lambda hs, parent: stored.append(hs), on_removed=removed.append)
    prompt = words("p", 40)
    a1, a2 = block_hashes(prompt)
    # A: 40 prompt + 8 output tokens = 3 blocks; nothing cached yet
    alloc_a = kv.allocate([a1, a2], 40, 3)
    assert alloc_a is not None and alloc_a.hit_tokens == 0
    assert (kv.used, kv.queries, kv.hits) == (3, 40, 0)
    # A ends: its 8 prompt-tail tokens and 8 output tokens fill a third block a3
    (a3,) = block_hashes(prompt[32:] + words("o", 8), a2)
    kv.release(alloc_a, [a3])
    assert kv.used == 0
    assert kv.cached_blocks() == [a3, a2, a1]  # tail first: the shared start is evicted last

    # B: the same prompt hits both full blocks (32 tokens); needs 1 more block, no eviction
    alloc_b = kv.allocate([a1, a2], 40, 3)
    assert alloc_b is not None and alloc_b.hit_tokens == 32
    assert (kv.used, kv.queries, kv.hits) == (3, 80, 32)
    assert kv.cached_blocks() == [a3]
    assert kv.usage == 0.75

    # C: 20 tokens, 2 blocks; only 1 block is free or evictable while B runs -> must wait
    (c1,) = block_hashes(words("c", 20))
    assert kv.allocate([c1], 20, 2) is None
    assert kv.queries == 80  # a refused admission is not counted
    kv.release(alloc_b, [a3])  # a3 is already cached: not duplicated
    assert kv.cached_blocks() == [a3, a2, a1]

    # now C fits: 2 new blocks, 1 empty, so the least recently freed (a3) is evicted
    alloc_c = kv.allocate([c1], 20, 2)
    assert alloc_c is not None
    assert removed == [[a3]]
    assert a3 not in kv and a1 in kv and a2 in kv
    assert kv.cached_blocks() == [a2, a1]

    # D: a prompt of exactly 32 tokens may hit only 1 block (one token must be computed)
    alloc_d = kv.allocate([a1, a2], 32, 2)
    assert alloc_d is not None and alloc_d.hit_tokens == 16
    assert (kv.queries, kv.hits) == (80 + 20 + 32, 32 + 16)
    # the room for the recomputed block came from evicting the cached a2, which is stored again
    assert removed == [[a3], [a2]]
    assert stored[-1] == [a2]
    assert kv.used == 4 and a2 in kv
    kv.release(alloc_c)
    kv.release(alloc_d)
    assert kv.used == 0


def test_shared_blocks_count_once_in_usage() -> None:
    kv = KVCache(10)
    hs = block_hashes(words("s", 64))  # 4 blocks
    first = kv.allocate(hs, 64, 5)
    assert first is not None
    second = kv.allocate(hs, 64, 5)  # 3 hits (one token computed): 2 new blocks
    assert second is not None and second.hit_tokens == 48
    assert kv.used == 5 + 2
    kv.release(first)
    kv.release(second)
    assert kv.used == 0
    assert len(kv.cached_blocks()) == 4


async def test_prefill_time_follows_uncached_tokens(sim_factory: SimFactory) -> None:
    # 1000 tokens/s: a 400-token prompt prefills in 0.4 s; again, 384 tokens hit and 16 cost 0.016 s
    sim = sim_factory("--served-model-name", "m", "--prefill-tokens-per-second", "1000")
    prompt = " ".join(words("w", 400))
    async with AsyncOpenAI(base_url=sim.base_url, api_key="x", max_retries=0) as c:

        async def ttft(text: str) -> float:
            t0 = time.monotonic()
            stream = await c.completions.create(model="m", prompt=text, max_tokens=2, stream=True)
            first = None
            async for ch in stream:
                if first is None and ch.choices and ch.choices[0].text:
                    first = time.monotonic() - t0
            assert first is not None
            return first

        cold = await ttft(prompt)
        warm = await ttft(prompt)
        # two different prompts at once share the one prefill lane: the later one waits ~0.8 s
        both = await asyncio.gather(ttft(" ".join(words("x", 400))), ttft(" ".join(words("y", 400))))
    assert cold >= 0.4
    assert warm < cold - 0.2
    assert max(both) >= 0.8
    async with aiohttp.ClientSession() as s:
        m = await scrape(s, sim.url)
    assert m["vllm:prefix_cache_queries_total"] == 4 * 400
    assert m["vllm:prefix_cache_hits_total"] == 384
    assert m["vllm:kv_cache_usage_perc"] == 0
    assert m["vllm:num_requests_waiting"] == 0


async def test_kv_capacity_queues_requests(sim_factory: SimFactory) -> None:
    # 64 tokens = 4 blocks; a 40-token prompt with 20 output tokens needs all 4: one at a time
    sim = sim_factory("--served-model-name", "m", "--kv-cache-tokens", "64", "--tokens-per-second", "20")
    async with aiohttp.ClientSession() as s, AsyncOpenAI(base_url=sim.base_url, api_key="x") as c:
        tasks = [
            asyncio.create_task(c.completions.create(model="m", prompt=" ".join(words(p, 40)), max_tokens=20))
            for p in ("a", "b")
        ]
        deadline = time.monotonic() + 5
        m = await scrape(s, sim.url)
        while not (m["vllm:num_requests_running"] == 1 and m["vllm:num_requests_waiting"] == 1):
            assert time.monotonic() < deadline, m
            await asyncio.sleep(0.02)
            m = await scrape(s, sim.url)
        assert m["vllm:kv_cache_usage_perc"] == 1.0
        done = await asyncio.gather(*tasks)
        too_big = await s.post(
            f"{sim.url}/v1/completions", json={"model": "m", "prompt": " ".join(words("z", 60)), "max_tokens": 20}
        )
        assert too_big.status == 400
        assert "KV-cache blocks" in (await too_big.json())["error"]["message"]
    assert [d.usage.completion_tokens for d in done if d.usage] == [20, 20]
