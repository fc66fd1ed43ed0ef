"""Every shipped example runs: `wakegate up` starts it, and every name /v1/models lists is served."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import REPO_ROOT
from tests.support.http import get_json, request
from tests.support.up import UpProcess
from wakegate.control.schema import parse_models

EXAMPLES = sorted((REPO_ROOT / "examples").glob("*.yaml"))


def test_there_are_examples() -> None:
    assert EXAMPLES


@pytest.fixture(params=EXAMPLES, ids=lambda path: path.name)
def running(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[UpProcess, Path]]:
    example: Path = request.param
    up = UpProcess(tmp_path, example.read_text())
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
        assert reply.json()["model"] == (name if "parent" in entry else entry["root"]), name
