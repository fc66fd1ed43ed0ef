"""The simulator's run-time LoRA API, shaped like vLLM's with --enable-lora: load and unload,
--max-loras, adapter names in /v1/models, and the vllm:lora_requests_info gauge; and the gateway's
reading of that gauge."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import aiohttp
import openai

from wakegate.extproc.engines import parse

if TYPE_CHECKING:
    from tests.support.sim import SimFactory


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, str]) -> tuple[int, str]:
    async with session.post(url, json=body) as resp:
        return resp.status, await resp.text()


async def test_adapters_load_serve_report_and_unload(sim_factory: SimFactory) -> None:
    sim = sim_factory("--served-model-name", "base", "--enable-lora", "--max-loras", "2", "--tokens-per-second", "20")
    client = openai.AsyncOpenAI(base_url=sim.base_url, api_key="x", max_retries=0, timeout=10)
    async with aiohttp.ClientSession() as s:
        with_lora = await (await s.get(f"{sim.url}/metrics")).text()
        state = parse(with_lora)
        assert state is not None and (state.adapters, state.max_adapters) == (frozenset(), 2)
        # Not loaded: as vLLM, the adapter's name is an unknown model.
        try:
            await client.completions.create(model="sql", prompt="hi", max_tokens=1)
            raise AssertionError("an adapter that is not loaded answered")
        except openai.NotFoundError:
            pass
        assert await post(s, f"{sim.url}/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a/sql"}) == (
            200,
            "Success: LoRA adapter 'sql' added successfully.",
        )
        status, text = await post(s, f"{sim.url}/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a/sql"})
        assert status == 400 and "already been loaded" in text
        assert (await post(s, f"{sim.url}/v1/load_lora_adapter", {"lora_name": "poet", "lora_path": "/a/p"}))[0] == 200
        status, text = await post(s, f"{sim.url}/v1/load_lora_adapter", {"lora_name": "third", "lora_path": "/a/t"})
        assert status == 400 and "--max-loras 2" in text
        models = {m.id: m for m in (await client.models.list()).data}
        assert getattr(models["sql"], "parent", None) == "base" and getattr(models["sql"], "root", None) == "/a/sql"

        # While a request of `sql` runs, the gauge names it running.
        slow = asyncio.create_task(client.completions.create(model="sql", prompt="hi", max_tokens=10))
        for _ in range(100):
            state = parse(await (await s.get(f"{sim.url}/metrics")).text())
            if state is not None and state.adapters:
                break
            await asyncio.sleep(0.02)
        assert state is not None and state.adapters == frozenset({"sql"})
        assert (await slow).model == "sql"
        # As vLLM, the sample of that past state stays; the newest one says nothing runs now.
        text = await (await s.get(f"{sim.url}/metrics")).text()
        assert 'running_lora_adapters="sql"' in text
        state = parse(text)
        assert state is not None and state.adapters == frozenset()

        assert (await post(s, f"{sim.url}/v1/unload_lora_adapter", {"lora_name": "sql"}))[0] == 200
        status, text = await post(s, f"{sim.url}/v1/unload_lora_adapter", {"lora_name": "sql"})
        assert status == 404 and "cannot be found" in text
        assert "sql" not in {m.id for m in (await client.models.list()).data}
    await client.close()


async def test_without_enable_lora_there_is_no_adapter_api(sim_factory: SimFactory) -> None:
    sim = sim_factory()
    async with aiohttp.ClientSession() as s:
        status, _ = await post(s, f"{sim.url}/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a"})
        assert status == 404
        assert "lora_requests_info" not in await (await s.get(f"{sim.url}/metrics")).text()


def test_the_gauge_is_read_as_vllm_writes_it() -> None:
    text = (
        'vllm:num_requests_running{model_name="b"} 2.0\n'
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters="c"} 1.7e9\n'
    )
    state = parse(text)
    assert state is not None and state.adapters == frozenset({"a", "b", "c"}) and state.max_adapters == 4
    empty = parse('vllm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""} 1\n')
    assert empty is not None and (empty.adapters, empty.max_adapters) == (frozenset(), 1)
