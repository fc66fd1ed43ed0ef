"""Generate a small Hugging Face Llama model folder (and PEFT LoRA adapters for it) for vLLM.

`python -m e2e.hfmodel --out DIR [--layers N --dim D --seed S] [--lora-out DIR --lora-seed S]`

What vLLM loads from a model folder, written without torch or transformers: `config.json`
(a `LlamaForCausalLM`), `model.safetensors` (random float32 weights from the seed, written by
hand: the format is a length, a JSON header and the raw tensors), `tokenizer.json` (a byte-level
BPE in the Hugging Face `tokenizers` format, its merges learned here from a fixed text), and
`tokenizer_config.json` with a ChatML chat template. An adapter folder holds PEFT's
`adapter_config.json` and `adapter_model.safetensors`.

As with e2e/tinymodel.py's GGUF, the output rows of every token but the printable ASCII ones
and the learned merges are zero, so greedy decoding never ends a reply early (the end token is
silent) or emits a partial UTF-8 sequence: a reply is exactly `max_tokens` tokens long. The
attention heads are 32 wide, the smallest vLLM's CPU attention takes.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import numpy as np

from e2e import llama

#: special tokens: the padding/end-of-text token and ChatML's two markers (ids 0, 1, 2)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ENDOFTEXT, IM_START, IM_END = range(len(SPECIALS))
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
#: the text the BPE merges are learned from (its most frequent pairs first)
CORPUS = (
    "the weather today is sunny and warm with a light wind from the west; tomorrow there will be "
    "rain in the morning and clouds in the afternoon. tell me about the weather, the sea, the "
    "mountains and the rivers; write a poem about the stars; what is the capital of the country "
    "that has the longest river in the world? please answer in one short sentence."
)
#: the projections a generated adapter adapts (all of a Llama block's linear layers)
LORA_TARGETS = llama.lora_targets("hf")
HEAD_DIM = 32


def byte_alphabet() -> list[str]:
    """GPT-2's byte-to-character table: byte b is written as the character at index b."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def learn_merges(text: str, count: int) -> list[tuple[str, str]]:
    """`count` BPE merges learned from `text` (words split as the byte-level pre-tokenizer does:
    a word keeps the space before it), most frequent pair first, ties by the pair itself."""
    alphabet = byte_alphabet()
    words: Counter[tuple[str, ...]] = Counter()
    for i, plain in enumerate(text.split(" ")):
        raw = (" " if i else "") + plain
        words[tuple(alphabet[b] for b in raw.encode())] += 1
    merges: list[tuple[str, str]] = []
    while len(merges) < count:
        pairs: Counter[tuple[str, str]] = Counter()
        for pieces, n in words.items():
            for pair in pairwise(pieces):
                pairs[pair] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if pairs[best] < 2:
            break
        merges.append(best)
        merged: Counter[tuple[str, ...]] = Counter()
        for pieces, n in words.items():
            out: list[str] = []
            i = 0
            while i < len(pieces):
                if i + 1 < len(pieces) and (pieces[i], pieces[i + 1]) == best:
                    out.append(pieces[i] + pieces[i + 1])
                    i += 2
                else:
                    out.append(pieces[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return merges


@dataclass(frozen=True)
class HFModelSpec(llama.Shape):
    """The shape of a generated model; the same spec and seed give the same files."""

    layers: int = 2
    dim: int = 128
    merges: int = 96
    seed: int = 0
    context: int = 512

    @property
    def head_dim(self) -> int:
        return HEAD_DIM

    def validate(self) -> None:
        self.check_shape(f"a multiple of {HEAD_DIM}")

    def vocabulary(self) -> tuple[dict[str, int], list[tuple[str, str]]]:
        """Token -> id (specials, the 256 bytes, then one token per merge) and the merges."""
        merges = learn_merges(CORPUS, self.merges)
        tokens = [*SPECIALS, *byte_alphabet(), *(a + b for a, b in merges)]
        return {token: i for i, token in enumerate(tokens)}, merges

    @property
    def vocab_size(self) -> int:
        """The embedding's rows: the tokenizer's tokens rounded up to a multiple of 64."""
        return -(-len(self.vocabulary()[0]) // 64) * 64

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape (rows = outputs), as transformers' LlamaForCausalLM names them."""
        return llama.shapes("hf", layers=self.layers, dim=self.dim, vocab=self.vocab_size)


def write_safetensors(path: Path, tensors: Mapping[str, np.ndarray]) -> Path:
    """The safetensors format: an 8-byte little-endian header length, the JSON header (name ->
    dtype, shape, byte range), padded to 8 bytes, then the tensors' bytes in order."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, array in tensors.items():
        size = array.nbytes
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for array in tensors.values():
            f.write(np.ascontiguousarray(array, dtype="<f4").tobytes())
    return path


def _random(seed: int, index: int, shape: tuple[int, ...], std: float) -> np.ndarray:
    """One tensor's values: its own stream of the seed, so tensors do not depend on order."""
    rng = np.random.default_rng([seed, index])
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)


def _speaking(vocab: Mapping[str, int]) -> list[int]:
    """Ids greedy decoding may pick: printable ASCII bytes (and the space) and learned merges."""
    alphabet = byte_alphabet()
    ascii_chars = {alphabet[b] for b in range(0x20, 0x7F)}
    return sorted(i for token, i in vocab.items() if token not in SPECIALS and set(token) <= ascii_chars)


def _weights(spec: HFModelSpec) -> Iterator[tuple[str, np.ndarray]]:
    vocab, _ = spec.vocabulary()
    speaking = _speaking(vocab)
    for index, (name, shape) in enumerate(spec.tensors().items()):
        if len(shape) == 1:
            yield name, np.ones(shape, dtype=np.float32)  # RMS-norm gains: unit scale throughout
        elif name == "lm_head.weight":
            # Logits with a standard deviation of ~4 (wide gaps between the top tokens); every
            # other row zero, so those tokens never win.
            full = _random(spec.seed, index, shape, 4.0 / np.sqrt(shape[1]))
            out = np.zeros(shape, dtype=np.float32)
            out[speaking] = full[speaking]
            yield name, out
        elif name == "model.embed_tokens.weight":
            yield name, _random(spec.seed, index, shape, 1.0)
        else:
            yield name, _random(spec.seed, index, shape, 1.0 / np.sqrt(shape[1]))


def tokenizer_json(spec: HFModelSpec) -> dict[str, object]:
    """The `tokenizers` serialisation of a byte-level BPE (GPT-2's scheme) with the specials."""
    vocab, merges = spec.vocabulary()
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, t in enumerate(SPECIALS)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": {"type": "ByteLevel", **byte_level},
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [[a, b] for a, b in merges],
        },
    }


def write_model(folder: Path, spec: HFModelSpec = HFModelSpec()) -> Path:
    """Write the model folder for `spec` to `folder`; returns `folder`."""
    spec.validate()
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.dim,
        "intermediate_size": spec.ffn,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.heads,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": spec.context,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": spec.vocab_size,
        "bos_token_id": IM_START,
        "eos_token_id": IM_END,
        "pad_token_id": ENDOFTEXT,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": IM_START, "eos_token_id": IM_END, "pad_token_id": ENDOFTEXT}, indent=2) + "\n"
    )
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json(spec), ensure_ascii=False) + "\n")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": SPECIALS[IM_END],
        "pad_token": SPECIALS[ENDOFTEXT],
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.context,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    write_safetensors(folder / "model.safetensors", dict(_weights(spec)))
    return folder


def write_lora(folder: Path, spec: HFModelSpec = HFModelSpec(), rank: int = 8, seed: int | None = None) -> Path:
    """Write a PEFT LoRA adapter folder for the model of `spec`; returns `folder`.

    The adapter's seed defaults to the model's plus one. Its update is about as large as the
    weights it adapts (alpha = rank), which changes greedy output.
    """
    spec.validate()
    if rank < 1:
        raise ValueError(f"--lora-rank must be at least 1, not {rank}")
    lora_seed = spec.seed + 1 if seed is None else seed
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    index = 0
    for name, shape in spec.tensors().items():
        module = name.split(".")[-2]
        if len(shape) != 2 or module not in LORA_TARGETS:
            continue
        rows, cols = shape
        stem = "base_model.model." + name.removesuffix(".weight")
        tensors[f"{stem}.lora_A.weight"] = _random(lora_seed, index, (rank, cols), 1.0 / np.sqrt(cols))
        tensors[f"{stem}.lora_B.weight"] = _random(lora_seed, index + 1, (rows, rank), 1.0 / np.sqrt(rank))
        index += 2
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "target_modules": list(LORA_TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_safetensors(folder / "adapter_model.safetensors", tensors)
    return folder


def main(argv: list[str] | None = None) -> int:
    defaults = HFModelSpec()
    parser = argparse.ArgumentParser(prog="python -m e2e.hfmodel", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the model folder to write")
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--dim", type=int, default=defaults.dim, help=f"model width (a multiple of {HEAD_DIM})")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--lora-out", type=Path, help="also write a matching PEFT LoRA adapter folder here")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--lora-seed", type=int)
    args = parser.parse_args(argv)
    spec = HFModelSpec(layers=args.layers, dim=args.dim, seed=args.seed)
    try:
        spec.validate()
    except ValueError as exc:
        parser.error(str(exc))
    write_model(args.out, spec)
    print(f"model: {args.out}")
    if args.lora_out is not None:
        write_lora(args.lora_out, spec, rank=args.lora_rank, seed=args.lora_seed)
        print(f"lora: {args.lora_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
