"""The generated Hugging Face model and adapter folders, read back without any engine: the
safetensors header and data, the config, the tokenizer's vocabulary and the PEFT layout."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from e2e.hfmodel import (
    CHAT_TEMPLATE,
    IM_END,
    LORA_TARGETS,
    SPECIALS,
    HFModelSpec,
    byte_alphabet,
    write_lora,
    write_model,
)


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    header.pop("__metadata__")
    data = raw[8 + size :]
    out = {}
    for name, entry in header.items():
        assert entry["dtype"] == "F32"
        begin, end = entry["data_offsets"]
        out[name] = np.frombuffer(data[begin:end], dtype="<f4").reshape(entry["shape"])
    return out


def test_the_model_folder_is_a_llama_with_its_tokenizer(tmp_path: Path) -> None:
    spec = HFModelSpec(layers=3, dim=64)
    folder = write_model(tmp_path / "m", spec)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["head_dim"]) == (3, 64, 32)
    assert config["eos_token_id"] == IM_END and config["vocab_size"] == spec.vocab_size
    tensors = read_safetensors(folder / "model.safetensors")
    assert {name: a.shape for name, a in tensors.items()} == spec.tensors()
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    assert [vocab[t] for t in SPECIALS] == [0, 1, 2]
    assert all(vocab[c] == len(SPECIALS) + b for b, c in enumerate(byte_alphabet()))
    # Every merge joins two tokens that exist, into one that exists.
    for a, b in tokenizer["model"]["merges"]:
        assert a in vocab and b in vocab and a + b in vocab
    assert len(vocab) <= spec.vocab_size
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    # Only printable text can win a greedy pick: the specials' and non-ASCII bytes' rows are zero.
    head = tensors["lm_head.weight"]
    assert not head[list(range(len(SPECIALS)))].any()
    assert not head[len(SPECIALS) + 0x80].any() and head[vocab["the"]].any()


def test_the_seed_decides_the_weights(tmp_path: Path) -> None:
    a = (write_model(tmp_path / "a", HFModelSpec(seed=3)) / "model.safetensors").read_bytes()
    b = (write_model(tmp_path / "b", HFModelSpec(seed=3)) / "model.safetensors").read_bytes()
    c = (write_model(tmp_path / "c", HFModelSpec(seed=4)) / "model.safetensors").read_bytes()
    assert a == b and a != c and len(a) == len(c)


def test_an_adapter_is_a_peft_folder_for_every_projection(tmp_path: Path) -> None:
    spec = HFModelSpec()
    folder = write_lora(tmp_path / "lora", spec, rank=4, seed=9)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["target_modules"]) == ("LORA", 4, list(LORA_TARGETS))
    tensors = read_safetensors(folder / "adapter_model.safetensors")
    assert len(tensors) == 2 * len(LORA_TARGETS) * spec.layers
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    assert tensors[f"{q}.lora_A.weight"].shape == (4, spec.dim)
    assert tensors[f"{q}.lora_B.weight"].shape == (spec.dim, 4)
    down = "base_model.model.model.layers.1.mlp.down_proj"
    assert tensors[f"{down}.lora_A.weight"].shape == (4, spec.ffn)
    other = read_safetensors(write_lora(tmp_path / "other", spec, rank=4, seed=10) / "adapter_model.safetensors")
    assert not np.array_equal(other[f"{q}.lora_A.weight"], tensors[f"{q}.lora_A.weight"])
