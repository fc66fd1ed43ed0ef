"""The generated GGUF files, read back with the `gguf` package (no engine needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFReader, TokenType

from e2e.tinymodel import CHAT_TEMPLATE, LORA_TARGETS, ModelSpec, write_lora, write_model


def fields(path: Path) -> dict[str, Any]:
    reader = GGUFReader(path)
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def test_model_has_a_real_spm_tokenizer_and_chat_template(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m.gguf", ModelSpec(vocab=600))
    kv = fields(path)
    assert kv["general.architecture"] == "llama"
    assert kv["tokenizer.ggml.model"] == "llama"
    tokens = kv["tokenizer.ggml.tokens"]
    types = kv["tokenizer.ggml.token_type"]
    scores = kv["tokenizer.ggml.scores"]
    assert len(tokens) == len(types) == len(scores) == 600 == kv["llama.vocab_size"]
    assert len(set(tokens)) == 600
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert [tokens[i] for i in range(len(tokens)) if types[i] == TokenType.BYTE] == [f"<0x{b:02X}>" for b in range(256)]
    assert types[kv["tokenizer.ggml.unknown_token_id"]] == TokenType.UNKNOWN
    assert tokens[kv["tokenizer.ggml.bos_token_id"]] == "<s>"
    assert tokens[kv["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"
    normal = [scores[i] for i in range(len(tokens)) if types[i] == TokenType.NORMAL]
    assert normal == sorted(normal, reverse=True)
    assert kv["tokenizer.chat_template"] == CHAT_TEMPLATE


def test_tensor_shapes_follow_the_spec(tmp_path: Path) -> None:
    spec = ModelSpec(layers=3, dim=32, vocab=400)
    reader = GGUFReader(write_model(tmp_path / "m.gguf", spec))
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    assert shapes == spec.tensors()
    assert {k: fields(tmp_path / "m.gguf")[k] for k in ("llama.block_count", "llama.embedding_length")} == {
        "llama.block_count": 3,
        "llama.embedding_length": 32,
    }


def test_the_seed_decides_the_weights(tmp_path: Path) -> None:
    a = write_model(tmp_path / "a.gguf", ModelSpec(seed=3)).read_bytes()
    b = write_model(tmp_path / "b.gguf", ModelSpec(seed=3)).read_bytes()
    c = write_model(tmp_path / "c.gguf", ModelSpec(seed=4)).read_bytes()
    assert a == b
    assert a != c
    assert len(a) == len(c)


def test_special_and_byte_tokens_are_never_predicted(tmp_path: Path) -> None:
    reader = GGUFReader(write_model(tmp_path / "m.gguf"))
    output = next(t for t in reader.tensors if t.name == "output.weight").data
    types = np.array(fields(tmp_path / "m.gguf")["tokenizer.ggml.token_type"])
    assert not output[types != TokenType.NORMAL].any()
    assert np.abs(output[types == TokenType.NORMAL]).min(axis=1).all()


def test_lora_adapter_matches_the_model(tmp_path: Path) -> None:
    spec = ModelSpec(layers=2, dim=64)
    reader = GGUFReader(write_lora(tmp_path / "l.gguf", spec, rank=4))
    kv = fields(tmp_path / "l.gguf")
    assert (kv["general.type"], kv["adapter.type"], kv["adapter.lora.alpha"]) == ("adapter", "lora", 4.0)
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    base = spec.tensors()
    for layer in range(2):
        for target in LORA_TARGETS:
            rows, cols = base[f"blk.{layer}.{target}.weight"]
            assert shapes[f"blk.{layer}.{target}.weight.lora_a"] == (4, cols)
            assert shapes[f"blk.{layer}.{target}.weight.lora_b"] == (rows, 4)
    assert len(shapes) == 2 * 2 * len(LORA_TARGETS)


def test_cli_writes_both_files_and_refuses_a_bad_shape(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "e2e.tinymodel",
            "--out",
            str(tmp_path / "m.gguf"),
            "--layers",
            "1",
            "--lora-out",
            str(tmp_path / "l.gguf"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "model:" in out.stdout and "lora:" in out.stdout
    assert fields(tmp_path / "m.gguf")["llama.block_count"] == 1
    assert fields(tmp_path / "l.gguf")["general.type"] == "adapter"
    bad = subprocess.run(
        [sys.executable, "-m", "e2e.tinymodel", "--out", str(tmp_path / "x.gguf"), "--dim", "40"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    assert "--dim must be a multiple of 16" in bad.stderr
    assert "Traceback" not in bad.stderr
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("vocab", [100, 10**6])
def test_vocab_out_of_range_is_refused(vocab: int) -> None:
    with pytest.raises(ValueError, match="--vocab must be between"):
        ModelSpec(vocab=vocab).validate()
