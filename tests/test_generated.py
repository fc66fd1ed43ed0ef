"""Generated code committed to the repo stays in sync with its sources."""

from __future__ import annotations

import filecmp
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_protos_are_regenerated(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_protos
    finally:
        sys.path.pop(0)
    gen_protos.generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc produced nothing"
    for rel in generated:
        committed = ROOT / "proto" / rel
        if not filecmp.cmp(tmp_path / rel, committed, shallow=False):
            pytest.fail(
                f"{committed} is stale: run python scripts/gen_protos.py "
                f"(generated here by grpcio-tools {version('grpcio-tools')}; pyproject.toml pins "
                "the version the committed files came from)"
            )


def test_upb_runtime_is_in_use() -> None:
    from google.protobuf.internal import api_implementation

    assert api_implementation.Type() == "upb"
