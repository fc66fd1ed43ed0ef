"""Every shipped example runs: `wakegate up` starts it, and every name /v1/models lists is served."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import REPO_ROOT
from tests.support.http import get_json, request
from tests.support.required import missing
from tests.support.up import UpProcess
from wakegate.control.manifests import parse_models
from wakegate.control.schema import Model

EXAMPLES = sorted((REPO_ROOT / "examples").glob("*.yaml"))


def test_there_are_examples() -> None:
    assert EXAMPLES


#: Backends whose engines `python -m e2e.engines` builds; their examples load a generated GGUF.
REAL_ENGINES = {"llamacpp": "llama-server", "ollama": "ollama"}


def _engine_env(models: list[Model], folder: Path) -> dict[str, str]:
    """PATH with the engines an example needs, and the GGUF its relative sources name."""
    from e2e import engines
    from e2e.tinymodel import ModelSpec, write_model

    dirs: list[str] = []
    for model in models:
        if model.spec.backend not in REAL_ENGINES:
            continue
        try:
            binary = engines.ensure(REAL_ENGINES[model.spec.backend])
        except engines.ToolchainMissing as exc:
            missing(str(exc))
        dirs.append(str(binary.parent))
        source = model.spec.source or ""
        if source.startswith("file://") and not source.startswith("file:///"):
            target = folder / source.removeprefix("file://")
            if not target.exists():
                write_model(target, ModelSpec())
    return {"PATH": os.pathsep.join([*dict.fromkeys(dirs), os.environ.get("PATH", "")])} if dirs else {}


@pytest.fixture(params=EXAMPLES, ids=lambda path: path.name)
def running(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[UpProcess, Path]]:
    example: Path = request.param
    env = _engine_env(parse_models(example.read_text(), str(example)), tmp_path)
    up = UpProcess(tmp_path, example.read_text(), env=env)
    try:
        models = parse_models(example.read_text(), str(example))
        up.wait_ready({m.key: m.spec.scaling.min for m in models}, timeout=90)
        yield up, example
    finally:
        assert up.stop() == 0, up.log()


def test_every_listed_name_answers_as_its_model(running: tuple[UpProcess, Path]) -> None:
    up, example = running
    models = parse_models(example.read_text(), str(example))
    listed = {entry["id"]: entry for entry in get_json(f"{up.base_url}/models")["data"]}
    expected = {name for m in models for name in (*m.client_names, *m.spec.loraAdapters)}
    assert set(listed) == expected
    for name, entry in listed.items():
        reply = request(
            "POST",
            f"{up.base_url}/chat/completions",
            body={"model": name, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2},
            timeout=30,
        )
        assert reply.status == 200, (name, reply.text)
        # Aliases reach the backend as its served name; an adapter keeps its own name.
        # (Ollama names a model with its tag: `tiny-ollama:latest`.)
        assert reply.json()["model"].removesuffix(":latest") == (name if "parent" in entry else entry["root"]), name
