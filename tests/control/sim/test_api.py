"""The simulator's OpenAI-compatible API, driven by the official openai client."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

if TYPE_CHECKING:
    from tests.support.sim import SimProcess


def client(sim: SimProcess) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=sim.base_url, api_key="x", max_retries=0, timeout=10)


async def test_chat_non_streaming(shared_sim: SimProcess) -> None:
    async with client(shared_sim) as c:
        r = await c.chat.completions.create(
            model="sim-model",
            messages=[
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hello there sim"},
            ],
            max_tokens=5,
        )
    assert r.object == "chat.completion"
    assert r.model == "sim-model"
    assert r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == "the quick brown fox jumps"
    assert choice.finish_reason == "length"
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 5, 10)


async def test_chat_streaming_matches_non_streaming(shared_sim: SimProcess) -> None:
    async with client(shared_sim) as c:
        full = await c.chat.completions.create(
            model="sim-alias", messages=[{"role": "user", "content": "one two"}], max_completion_tokens=40
        )
        stream = await c.chat.completions.create(
            model="sim-alias",
            messages=[{"role": "user", "content": "one two"}],
            max_completion_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    assert full.model == "sim-alias"  # the name the client asked for
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" and ch.model == "sim-alias" for ch in chunks)
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content == full.choices[0].message.content
    assert len(content.split()) == 40
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens) == (2, 40)


async def test_eos_finishes_with_stop(shared_sim: SimProcess) -> None:
    async with client(shared_sim) as c:
        r = await c.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "go"}], max_tokens=100
        )
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens == 50


async def test_completions(shared_sim: SimProcess) -> None:
    async with client(shared_sim) as c:
        r = await c.completions.create(model="sim-lora", prompt="a b c d", max_tokens=3)
        stream = await c.completions.create(
            model="sim-lora",
            prompt="a b c d",
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    assert r.object == "text_completion" and r.model == "sim-lora"
    assert r.choices[0].text == "the quick brown"
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (4, 3)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == "the quick brown"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 7


async def test_embeddings(shared_sim: SimProcess) -> None:
    async with client(shared_sim) as c:
        one = await c.embeddings.create(model="sim-model", input="hello world")  # client asks for base64
        two = await c.embeddings.create(model="sim-model", input=["hello world", "other"], encoding_format="float")
    vec = one.data[0].embedding
    assert len(vec) == 16
    assert math.isclose(sum(v * v for v in vec), 1.0, rel_tol=1e-5)
    assert [d.index for d in two.data] == [0, 1]
    assert two.data[0].embedding == pytest.approx(vec, abs=1e-6)  # deterministic; float32 vs float64
    assert two.data[1].embedding != two.data[0].embedding
    assert one.usage.prompt_tokens == 2 and two.usage.prompt_tokens == 3


async def test_models_lists_names_and_lora(shared_sim: SimProcess) -> None:
    async with client(shared_sim) as c:
        page = await c.models.list()
    by_id = {m.id: m for m in page.data}
    assert list(by_id) == ["sim-model", "sim-alias", "sim-lora"]
    assert by_id["sim-lora"].model_extra is not None
    assert by_id["sim-lora"].model_extra["parent"] == "sim-model"
    assert by_id["sim-lora"].model_extra["root"] == "/adapters/sim-lora"
    assert by_id["sim-model"].model_extra is not None
    assert by_id["sim-model"].model_extra["parent"] is None


async def test_unknown_model_is_404(shared_sim: SimProcess) -> None:
    async with client(shared_sim) as c:
        with pytest.raises(openai.NotFoundError) as info:
            await c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 404
    assert "The model `nope` does not exist." in str(info.value)


async def test_http_errors_and_defaults(shared_sim: SimProcess) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{shared_sim.base_url}/chat/completions", data=b"{not json") as r:
            assert r.status == 400
            err = (await r.json())["error"]
            assert err["type"] == "BadRequestError" and err["code"] == 400 and err["message"]
        async with s.get(f"{shared_sim.base_url}/chat/completions") as r:
            assert r.status == 405
            assert "error" in await r.json()
        async with s.get(f"{shared_sim.url}/nowhere") as r:
            assert r.status == 404
        async with s.post(f"{shared_sim.base_url}/completions", json={"prompt": "x", "max_tokens": 0}) as r:
            assert r.status == 400
        # no model: the primary served name answers, as in vLLM
        async with s.post(f"{shared_sim.base_url}/completions", json={"prompt": "x"}) as r:
            body = await r.json()
            assert r.status == 200 and body["model"] == "sim-model"
            assert body["usage"]["completion_tokens"] == 16  # --max-tokens-default
        async with s.get(f"{shared_sim.url}/metrics") as r:
            text = await r.text()
            assert r.status == 200
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert f'{name}{{engine="0",model_name="sim-model"' in text or f'{name}{{engine="0",le=' in text, name
    assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="sim-model"}' in text
