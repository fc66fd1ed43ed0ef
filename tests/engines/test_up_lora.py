"""LoRAAdapters on a real llama-server through `wakegate up`: two adapters of one generated base,
each request answered with its own adapter applied (the greedy completion is the one the engine
gives for that adapter by id, differs from the base's and from the other adapter's), the base
woken once from zero by adapter requests, and never restarted when another adapter is used."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from e2e.tinymodel import ModelSpec, write_lora
from tests.engines.conftest import PROMPT, TINY_LLAMA, TinyFiles, greedy, start_llama_server
from tests.engines.test_up_engines import engines_path, model_status, wait_for
from tests.support.models import document, manifest
from tests.support.up import UpProcess, pids_alive


def fleet_manifest(activation_timeout: int = 120) -> str:
    """The tiny model on llama-server with two adapters, from `weights/` beside the manifest."""
    scaling = {"min": 0, "max": 1, "idleTimeout": 300, "activationTimeout": activation_timeout}
    sql = {"baseModel": "llama", "source": "file://weights/sql.gguf", "servedName": "tiny-sql", "aliases": ["sql-v1"]}
    return manifest(
        document("Model", "llama", {**TINY_LLAMA, "scaling": scaling}),
        document("LoRAAdapter", "sql", sql),
        document("LoRAAdapter", "poet", {"baseModel": "llama", "source": "file://weights/poet.gguf", "scale": 1.0}),
    )


MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("loras")
    return (
        write_lora(folder / "sql.gguf", ModelSpec(seed=0), seed=11),
        write_lora(folder / "poet.gguf", ModelSpec(seed=0), seed=12),
    )


@pytest.fixture(scope="module")
def expected(tiny: TinyFiles, adapters: tuple[Path, Path], llama_server_bin: Path) -> dict[str, str]:
    """What the engine itself answers for the base and each adapter (by id, as loaded at start)."""
    server = start_llama_server(llama_server_bin, tiny.model, "--lora", str(adapters[0]), "--lora", str(adapters[1]))
    try:
        return {
            "base": greedy(server, max_tokens=MAX_TOKENS, lora=[{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]),
            "sql": greedy(server, max_tokens=MAX_TOKENS, lora=[{"id": 0, "scale": 1.0}]),
            "poet": greedy(server, max_tokens=MAX_TOKENS, lora=[{"id": 1, "scale": 1.0}]),
        }
    finally:
        server.stop()


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory, tiny: TinyFiles, adapters: tuple[Path, Path], llama_server_bin: Path
) -> Iterator[UpProcess]:
    tmp = tmp_path_factory.mktemp("up-lora")
    (tmp / "weights").mkdir()
    shutil.copy(tiny.model, tmp / "weights" / "tiny.gguf")
    shutil.copy(adapters[0], tmp / "weights" / "sql.gguf")
    shutil.copy(adapters[1], tmp / "weights" / "poet.gguf")
    up = UpProcess(tmp, fleet_manifest(), env=engines_path(llama_server_bin))
    try:
        up.wait_ready({"llama": 0}, timeout=90)
        yield up
    finally:
        assert up.stop() == 0, up.log()


def ask(up: UpProcess, name: str, how: str = "body") -> str:
    """A greedy completion of PROMPT naming `name` in the body, in X-Model-ID, or in the path."""
    base_url, headers, model = up.base_url, None, name
    if how == "header":
        headers, model = {"X-Model-ID": name}, "ignored-by-the-gateway"
    elif how == "path":
        base_url, model = f"{up.url}/model/{name}/v1", "also-ignored"
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model=model,
        messages=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        seed=7,  # type: ignore[arg-type]
        extra_headers=headers,
    )
    return reply.choices[0].message.content or ""


def test_adapters_apply_per_request_and_never_restart_the_base(fleet: UpProcess, expected: dict[str, str]) -> None:
    up = fleet
    # The adapter changes the logits: each greedy completion is its own.
    assert len({expected["base"], expected["sql"], expected["poet"]}) == 3, expected
    assert model_status(up, "llama")["replicas"] == []

    # Two adapter requests at once for the sleeping base: one activation wakes it for both.
    answers: dict[str, str] = {}
    threads = [threading.Thread(target=lambda n=n: answers.__setitem__(n, ask(up, n))) for n in ("sql", "poet")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert answers == {"sql": expected["sql"], "poet": expected["poet"]}
    assert up.log().count("scale model=llama from=0 to=1") == 1
    (replica,) = model_status(up, "llama")["replicas"]  # type: ignore[misc]
    pid = int(replica["pid"])

    # Interleaved, by every way a request names a model: each gets its adapter, the base none.
    for name, how, want in [
        ("sql", "header", "sql"),
        ("llama", "body", "base"),
        ("poet", "path", "poet"),
        ("tiny-sql", "body", "sql"),
        ("poet", "header", "poet"),
        ("sql-v1", "path", "sql"),
        ("poet", "body", "poet"),
        ("llama", "header", "base"),
    ]:
        assert ask(up, name, how) == expected[want], (name, how)

    # Still the one process that woke: no adapter cost a restart or another cold start.
    status = model_status(up, "llama")
    (replica,) = status["replicas"]  # type: ignore[misc]
    assert (int(replica["pid"]), replica["restarts"]) == (pid, 0) and pids_alive([pid]) == [pid]
    assert up.log().count("scale model=llama from=0 to=1") == 1
    adapters = status["adapters"]
    assert isinstance(adapters, dict) and set(adapters) == {"sql", "poet"}
    for name in ("sql", "poet"):
        assert adapters[name]["replicas"] == [f"llama-{replica['index']}"]
        assert adapters[name]["last_load"] is not None and adapters[name]["failure"] is None
    assert adapters["sql"]["served_name"] == "tiny-sql"

    # The listing shows the adapters with their base as parent.
    models = {m.id: m for m in openai.OpenAI(base_url=up.base_url, api_key="unused").models.list()}
    assert getattr(models["sql"], "parent", None) == "org/tiny-llama"
    assert getattr(models["poet"], "parent", None) == "org/tiny-llama"


def test_an_adapter_whose_weights_are_missing_fails_its_activation_with_the_reason(
    tmp_path: Path, tiny: TinyFiles, llama_server_bin: Path
) -> None:
    (tmp_path / "weights").mkdir()
    shutil.copy(tiny.model, tmp_path / "weights" / "tiny.gguf")
    # A start that fails is retried until the activation's time is up (docs/scaling.md): a short
    # activationTimeout, so the request hears the reason within the client's timeout.
    up = UpProcess(tmp_path, fleet_manifest(activation_timeout=6), env=engines_path(llama_server_bin))
    try:
        up.wait_ready({"llama": 0}, timeout=90)
        client = openai.OpenAI(base_url=up.base_url, api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(model="sql", messages=PROMPT, max_tokens=2)  # type: ignore[arg-type]
        assert caught.value.status_code == 503
        assert "LoRAAdapter sql" in str(caught.value.body)
        wait_for(lambda: model_status(up, "llama")["adapters"]["sql"]["failure"] is not None, 30, "the failure")  # type: ignore[index]
        failure = model_status(up, "llama")["adapters"]["sql"]["failure"]  # type: ignore[index]
        assert failure["reason"] and "sql.gguf" in failure["message"]
    finally:
        assert up.stop() == 0, up.log()
