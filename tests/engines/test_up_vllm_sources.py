"""`backend: vllm` Models whose weights come from a registry (`oci://`, the generated folder pushed
as one artifact) and from a Hugging Face Hub stand-in (`hf://`), under `wakegate up` at `min: 0`:
each is pulled into the machine's cache on its first wake and vLLM loads the entry's folder.
Both hold the same generated files, so both answer with the same greedy text. Two engine starts,
one after the other (each Model idles out before the next wakes)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from e2e.tools.registry import start_registry
from tests.control.delivery.test_hub import FakeHub, serving
from tests.engines.conftest import PROMPT, VLLM_ARGS, HFTiny
from tests.engines.test_up_engines import engines_path, model_status, wait_for
from tests.support.tools import registry_bin
from tests.support.up import UpProcess, pids_alive
from wakegate.control.delivery.pushing import push
from wakegate.control.delivery.registry import RegistrySettings

__all__ = ["registry_bin"]
pytestmark = pytest.mark.usefixtures("registry_bin")


def model_doc(name: str, source: str) -> str:
    return f"""---
apiVersion: wakegate.io/v1alpha1
kind: Model
metadata: {{name: {name}}}
spec:
  backend: vllm
  source: {source}
  args: {json.dumps(list(VLLM_ARGS))}
  scaling: {{min: 0, max: 1, idleTimeout: 2, activationTimeout: 300}}
"""


@dataclass
class Fleet:
    up: UpProcess
    folder: Path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, hf_tiny: HFTiny, vllm_bin: Path) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("up-vllm-sources")
    folder = hf_tiny.model
    files = {p.name: p.read_bytes() for p in sorted(folder.iterdir())}
    with start_registry(tmp / "reg") as reg, serving(FakeHub(files, {"model.safetensors"})) as hub:
        ref = f"oci://{reg.host}/models/tiny-hf:v1"
        asyncio.run(push(folder, ref, settings=RegistrySettings(docker_config=reg.docker_config)))
        env = {
            **engines_path(vllm_bin),
            "DOCKER_CONFIG": str(tmp / "no-docker"),
            "HF_ENDPOINT": hub.url,
            "HF_HUB_DISABLE_TELEMETRY": "1",
        }
        fleet_doc = model_doc("from-oci", ref) + model_doc("from-hf", "hf://org/tiny")
        cache_args = ("--cache-dir", str(tmp / "cache"), "--flash-dir", str(tmp / "flash"))  # not the machine's
        up = UpProcess(tmp, fleet_doc, *cache_args, env=env)
        try:
            up.wait_ready({"from-oci": 0, "from-hf": 0}, timeout=90)
            yield Fleet(up, folder)
        finally:
            assert up.stop() == 0, up.log()


def answer(up: UpProcess, model: str) -> str:
    client = openai.OpenAI(base_url=up.base_url, api_key="unused", max_retries=0, timeout=300)
    reply = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    return reply.choices[0].message.content or ""


def test_oci_and_hf_sources_wake_vllm_on_the_pulled_folder(fleet: Fleet) -> None:
    up = fleet.up
    answers = {}
    for key in ("from-oci", "from-hf"):
        assert model_status(up, key)["replicas"] == []
        answers[key] = answer(up, key)
        status = model_status(up, key)
        # vLLM was given the cache entry's folder: the same files as the generated one.
        weights = Path(str(status["weights"]))
        assert weights.is_dir() and weights.is_relative_to(up.tmp / "cache")
        for name in ("config.json", "tokenizer.json", "model.safetensors"):
            want = hashlib.sha256((fleet.folder / name).read_bytes()).hexdigest()
            assert hashlib.sha256((weights / name).read_bytes()).hexdigest() == want, (key, name)
        delivery = status["delivery"]
        assert isinstance(delivery, dict) and delivery["pulls"] == 1, delivery
        # Asleep again before the next one wakes: one vLLM at a time.
        (replica,) = status["replicas"]  # type: ignore[misc]
        pid = int(replica["pid"])
        wait_for(lambda k=key: model_status(up, k)["replicas"] == [], 90, f"{key} to sleep")  # type: ignore[misc]
        wait_for(lambda p=pid: pids_alive([p]) == [], 60, f"{key}'s engine to exit")  # type: ignore[misc]
    assert answers["from-oci"] == answers["from-hf"] and answers["from-oci"], answers
