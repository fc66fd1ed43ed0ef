"""The simulator's sleep mode, as vLLM documents its API: /sleep?level=1|2, /wake_up (with tags),
/is_sleeping, /collective_rpc reload_weights; what a sleeping engine refuses, and the memory it
gives back. The vLLM plugin's sleep steps are run against it here (wakegate up's Engine)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import aiohttp
import pytest

from wakegate.control.backends import BACKENDS
from wakegate.control.up.engine import Engine, EngineError

if TYPE_CHECKING:
    from tests.support.sim import SimFactory

MB = 1024 * 1024


async def _memory(s: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    text = await (await s.get(f"{url}/metrics")).text()
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("wakegate_sim_") and not line.startswith("#")
    }
    return values["wakegate_sim_accelerator_memory_bytes"], values["wakegate_sim_host_memory_bytes"]


async def _chat(s: aiohttp.ClientSession, url: str) -> int:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with s.post(f"{url}/v1/chat/completions", json=body) as resp:
        return resp.status


async def test_level1_offloads_weights_and_wakes(sim_factory: SimFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    sim = sim_factory("--served-model-name", "m", "--enable-sleep-mode", "--weights-mb", "100",
                      "--kv-cache-mb", "50", "--context-mb", "10", "--wake-seconds", "0.01")
    async with aiohttp.ClientSession() as s:
        assert await (await s.get(f"{sim.url}/is_sleeping")).json() == {"is_sleeping": False}
        assert await _memory(s, sim.url) == (160 * MB, 0)
        assert (await s.post(f"{sim.url}/sleep?level=1")).status == 200
        assert await (await s.get(f"{sim.url}/is_sleeping")).json() == {"is_sleeping": True}
        # Weights in host memory, KV cache gone, the context stays on the accelerator.
        assert await _memory(s, sim.url) == (10 * MB, 100 * MB)
        assert await _chat(s, sim.url) == 503
        assert (await s.get(f"{sim.url}/health")).status == 200  # the process serves on
        assert (await s.post(f"{sim.url}/wake_up")).status == 200
        assert await (await s.get(f"{sim.url}/is_sleeping")).json() == {"is_sleeping": False}
        assert await _memory(s, sim.url) == (160 * MB, 0)
        assert await _chat(s, sim.url) == 200
        assert (await s.post(f"{sim.url}/sleep?level=3")).status == 400


async def test_level2_needs_the_weights_reloaded(sim_factory: SimFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    sim = sim_factory("--served-model-name", "m", "--enable-sleep-mode", "--weights-mb", "100",
                      "--kv-cache-mb", "50", "--context-mb", "10", "--reload-weights-seconds", "0.01")
    async with aiohttp.ClientSession() as s:
        assert (await s.post(f"{sim.url}/sleep?level=2")).status == 200
        assert await _memory(s, sim.url) == (10 * MB, 0)  # nothing kept in host memory
        # Waking everything without a reload leaves garbage weights: generation is an error.
        assert (await s.post(f"{sim.url}/wake_up")).status == 200
        assert await _chat(s, sim.url) == 500
        # The documented order: weights, reload, KV cache.
        assert (await s.post(f"{sim.url}/sleep?level=2")).status == 200
        assert (await s.post(f"{sim.url}/wake_up?tags=weights")).status == 200
        assert await (await s.get(f"{sim.url}/is_sleeping")).json() == {"is_sleeping": True}
        reload = await s.post(f"{sim.url}/collective_rpc", json={"method": "reload_weights"})
        assert reload.status == 200
        assert (await s.post(f"{sim.url}/wake_up?tags=kv_cache")).status == 200
        assert await (await s.get(f"{sim.url}/is_sleeping")).json() == {"is_sleeping": False}
        assert await _chat(s, sim.url) == 200
        bad = await s.post(f"{sim.url}/wake_up?tags=everything")
        assert bad.status == 400 and "unknown tags" in (await bad.json())["error"]["message"]


async def test_the_api_exists_only_in_dev_mode(sim_factory: SimFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    sim = sim_factory("--enable-sleep-mode")
    async with aiohttp.ClientSession() as s:
        assert (await s.post(f"{sim.url}/sleep?level=1")).status == 404
        assert (await s.get(f"{sim.url}/is_sleeping")).status == 404


@pytest.mark.parametrize("level", [1, 2])
async def test_the_vllm_plugin_sleeps_and_wakes_the_engine(
    sim_factory: SimFactory, monkeypatch: pytest.MonkeyPatch, level: int
) -> None:
    """`wakegate up`'s steps for vLLM, against the sim's implementation of vLLM's API."""
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    sim = sim_factory("--served-model-name", "m", "--enable-sleep-mode", "--reload-weights-seconds", "0.01")
    backend = BACKENDS["vllm"]
    assert backend.can_sleep and "--enable-sleep-mode" in backend.sleep_args
    async with aiohttp.ClientSession() as s:
        engine = Engine(backend, s, "127.0.0.1", int(sim.url.rsplit(":", 1)[1]), {"served_name": "m"}, None)
        await engine.sleep(level)
        assert await _chat(s, sim.url) == 503
        await engine.wake(level)
        assert await _chat(s, sim.url) == 200
        # A step the engine refuses is an EngineError naming the step.
        engine.values["served_name"] = "m"
        backend_without_api = Engine(backend, s, "127.0.0.1", int(sim.url.rsplit(":", 1)[1]), {}, None)
        backend_without_api.base += "/nowhere"
        with pytest.raises(EngineError, match="put the engine to sleep"):
            await backend_without_api.sleep(1)
