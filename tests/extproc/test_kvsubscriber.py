"""KV events over real ZMQ: a real `wakegate sim` publishing, extproc's subscriber keeping the index.

The sim tests run the sim as a process and check the subscriber's index against a KVCache fed
the same requests (the sim's own model, hand-checked in tests/control/sim/test_kvcache.py).
The sequence-number tests publish from a bare ZMQ socket they control, to lose, repeat and
garble batches on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator

import aiohttp
import pytest
import zmq
import zmq.asyncio

from tests.support.sim import SimProcess, start_sim
from tests.support.waiting import waited
from wakegate.control.admin import free_port
from wakegate.control.sim.app import _output_hashes
from wakegate.control.sim.kvcache import KVCache, blocks_for
from wakegate.extproc.kvindex import KVIndex, Target
from wakegate.extproc.kvsubscriber import KVSubscriber
from wakegate.kvevents import END_SEQ, Stored, block_hashes, body_blocks, chat_tokens, encode_batch, seq_bytes

EP = "127.0.0.1:8000"  # the endpoint's name in the index; only the target's addresses are dialled


async def until(ok: Callable[[], bool], timeout: float = 10.0) -> None:
    await waited(ok, timeout, "the index to change")


@contextlib.asynccontextmanager
async def subscribed(targets: dict[str, Target], index: KVIndex) -> AsyncIterator[KVSubscriber]:
    sub = KVSubscriber(lambda: targets, index, interval=0.05, replay_timeout=0.5)
    task = asyncio.create_task(sub.run())
    try:
        yield sub
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# ---- a real sim -------------------------------------------------------------------------------


@pytest.fixture
def publishing_sim() -> Iterator[tuple[SimProcess, Target]]:
    events, replay = free_port(), free_port()
    config = (
        f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:{events}", '
        f'"replay_endpoint": "tcp://*:{replay}", "topic": "kv-events"}}'
    )
    # 16 blocks of cache: a few prompts fill it and evict
    sim = start_sim(0, "--kv-cache-tokens", "256", "--kv-events-config", config)
    yield sim, Target(f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}")
    sim.stop(timeout=5)


def prompt(n: int, length: int) -> dict[str, object]:
    text = " ".join(f"p{n}w{i}" for i in range(length))
    return {"model": "wakegate/sim", "messages": [{"role": "user", "content": text}], "max_tokens": 4}


async def send_and_model(sim: SimProcess, bodies: list[dict[str, object]], model: KVCache) -> None:
    """Send ``bodies`` one after another, and feed ``model`` what the sim does with each."""
    async with aiohttp.ClientSession() as session:
        for body in bodies:
            async with session.post(f"{sim.base_url}/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()
            messages = body["messages"]
            assert isinstance(messages, list)
            tokens = chat_tokens(messages)
            hashes = block_hashes(tokens)
            alloc = model.allocate(hashes, len(tokens), blocks_for(len(tokens) + 4))
            assert alloc is not None
            model.release(alloc, _output_hashes(tokens, hashes, 4))


async def test_the_index_follows_the_sims_cache_through_stores_and_evictions(
    publishing_sim: tuple[SimProcess, Target],
) -> None:
    sim, target = publishing_sim
    index = KVIndex()
    model = KVCache(16)
    async with subscribed({EP: target}, index):
        await asyncio.sleep(0.3)  # let the subscription join before the first batch
        bodies = [prompt(n, 70) for n in range(6)]  # 4-5 blocks each: the 16-block cache evicts
        await send_and_model(sim, bodies, model)
        expected = set(model.cached_blocks())
        await until(lambda: index.held(EP) == expected)
    assert index.gaps == 0 and index.last(EP) is not None
    # the newest prompt is held whole, the first one was evicted
    assert index.matches(body_blocks(bodies[-1])) == {EP: 4}
    assert index.matches(body_blocks(bodies[0])) == {}


async def test_a_late_subscriber_learns_the_history_from_the_replay_socket(
    publishing_sim: tuple[SimProcess, Target],
) -> None:
    sim, target = publishing_sim
    model = KVCache(16)
    bodies = [prompt(n, 40) for n in range(3)]
    await send_and_model(sim, bodies, model)  # nobody listens yet
    index = KVIndex()
    async with subscribed({EP: target}, index):
        expected = set(model.cached_blocks())
        await until(lambda: index.held(EP) == expected)  # asked for on subscribing
        assert index.matches(body_blocks(bodies[0])) == {EP: 2}
        await asyncio.sleep(0.2)
        await send_and_model(sim, [prompt(9, 40)], model)  # and live batches go on from there
        expected = set(model.cached_blocks())
        await until(lambda: index.held(EP) == expected)
    assert index.gaps == 0 and index.restarts == 0


# ---- a publisher the test controls ------------------------------------------------------------


class FakeEngine:
    """An XPUB (so the test knows when the subscriber joined) and a replay ROUTER, vLLM's shapes."""

    def __init__(self, ctx: zmq.asyncio.Context, replay: bool) -> None:
        self.ctx = ctx
        self.port, self.replay_port = free_port(), free_port()
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.buffer: list[tuple[int, bytes]] = []
        self.router: zmq.asyncio.Socket | None = None
        self.task: asyncio.Task[None] | None = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(f"tcp://127.0.0.1:{self.replay_port}")
            self.task = asyncio.create_task(self._serve())
        self.target = Target(f"tcp://127.0.0.1:{self.port}", f"tcp://127.0.0.1:{self.replay_port}" if replay else None)

    async def joined(self) -> None:
        frame = await asyncio.wait_for(self.pub.recv(), 5)
        assert frame[:1] == b"\x01"  # a subscription

    async def _serve(self) -> None:
        assert self.router is not None
        while True:
            client, empty, start = await self.router.recv_multipart()
            for seq, payload in self.buffer:
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart((client, empty, seq_bytes(seq), payload))
            await self.router.send_multipart((client, empty, END_SEQ, b""))

    async def publish(self, seq: int, block: bytes, *, lose: bool = False) -> None:
        payload = encode_batch(time.time(), [Stored((block,))])
        self.buffer.append((seq, payload))
        if not lose:
            await self.pub.send_multipart((b"kv-events", seq_bytes(seq), payload))

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        self.pub.close(0)
        if self.router is not None:
            self.router.close(0)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.term()


def block(n: int) -> bytes:
    return b"blk%05d" % n


@pytest.mark.parametrize("replay", [True, False])
async def test_a_gap_is_filled_from_replay_or_resets_the_endpoint(ctx: zmq.asyncio.Context, replay: bool) -> None:
    engine = FakeEngine(ctx, replay)
    index = KVIndex()
    try:
        async with subscribed({EP: engine.target}, index):
            await engine.joined()
            await engine.publish(0, block(0))
            await until(lambda: index.last(EP) == 0)
            await engine.publish(1, block(1), lose=True)  # the subscriber never sees batch 1
            await engine.publish(2, block(2))
            await until(lambda: index.last(EP) == 2)
            if replay:
                assert index.held(EP) == {block(0), block(1), block(2)} and index.gaps == 0
            else:  # batch 1 might have removed block 0: what was known is dropped
                assert index.held(EP) == {block(2)} and index.gaps == 1
    finally:
        await engine.close()


async def test_a_restarted_publisher_and_a_garbled_batch_drop_what_was_known(ctx: zmq.asyncio.Context) -> None:
    engine = FakeEngine(ctx, replay=False)
    index = KVIndex()
    try:
        async with subscribed({EP: engine.target}, index):
            await engine.joined()
            for seq in range(3):
                await engine.publish(seq, block(seq))
            await until(lambda: index.last(EP) == 2)
            await engine.publish(0, block(10))  # counting from 0 again: the engine restarted
            await until(lambda: index.held(EP) == {block(10)})
            assert index.restarts == 1
            await engine.pub.send_multipart((b"kv-events", seq_bytes(1), b"\xc1garbage"))
            await until(lambda: index.blocks(EP) == 0 and index.last(EP) == 1)
            await engine.publish(2, block(11))  # the garbled batch counted: no gap after it
            await until(lambda: index.held(EP) == {block(11)})
            assert index.gaps == 1
    finally:
        await engine.close()


async def test_an_endpoint_leaving_the_targets_is_unsubscribed_and_forgotten(ctx: zmq.asyncio.Context) -> None:
    engine = FakeEngine(ctx, replay=False)
    index = KVIndex()
    targets = {EP: engine.target}
    try:
        async with subscribed(targets, index):
            await engine.joined()
            await engine.publish(0, block(0))
            await until(lambda: index.blocks(EP) == 1)
            targets.clear()
            await until(lambda: index.last(EP) is None)
            await engine.publish(1, block(1))
            await asyncio.sleep(0.2)
            assert index.blocks(EP) == 0  # nothing taken from a publisher no longer followed
    finally:
        await engine.close()
