"""Generate a small llama-architecture GGUF (and optionally a LoRA adapter for it).

`python -m e2e.tinymodel --out FILE [--layers N --dim D --vocab V --seed S] [--lora-out FILE]`

The model has random weights drawn from the seed, so its text is gibberish, but
everything an engine needs to load and serve it is real: a SentencePiece-style
vocabulary (`<unk>`, `<s>`, `</s>`, two ChatML control tokens, the 256 byte
tokens, scored word pieces), a ChatML chat template that Ollama recognises, and
llama hyperparameters. llama-server and Ollama both load it and generate from it.

Two choices make the model convenient for tests:
- the output rows of the control, unknown and byte tokens are zero, so greedy
  decoding never ends a reply early or emits invalid UTF-8: a reply is exactly
  `max_tokens` printable pieces long;
- weights are scaled so that every layer (and so the prompt) moves the logits,
  with wide gaps between them, so greedy output is stable under the small
  numeric differences that batching or a prompt-cache hit introduce.

Tensors are written one at a time (header first, then each tensor as it is
generated), so writing a model of a few hundred MB needs memory for its largest
tensor only.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from string import ascii_lowercase

import numpy as np
from gguf import GGUFWriter, LlamaFileType, TokenType
from gguf.constants import Keys

from e2e import llama

ARCH = "llama"
#: the word-boundary marker SentencePiece vocabularies use
SPACE = "\u2581"
SPECIALS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
UNK, BOS, EOS, IM_START, IM_END = range(len(SPECIALS))
#: Ollama matches a GGUF's template against its own list; this one is its "chatml" entry,
#: so `ollama create` picks the ChatML prompt format and its stop words.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MIN_VOCAB = len(SPECIALS) + 256 + 32


@dataclass(frozen=True)
class ModelSpec(llama.Shape):
    """The shape of a generated model; the same spec and seed give the same file."""

    layers: int = 2
    dim: int = 64
    vocab: int = 512
    seed: int = 0
    context: int = 2048

    @property
    def head_dim(self) -> int:
        """16 for the tiny default, 64 (the usual size) once the model is wide enough."""
        return 64 if self.dim >= 256 else 16

    def validate(self) -> None:
        self.check_shape("a multiple of 16 (of 64 from 256 on)")
        if not MIN_VOCAB <= self.vocab <= MIN_VOCAB + _piece_capacity():
            raise ValueError(f"--vocab must be between {MIN_VOCAB} and {MIN_VOCAB + _piece_capacity()}")

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> numpy shape (rows = outputs), in file order."""
        return llama.shapes("gguf", layers=self.layers, dim=self.dim, vocab=self.vocab)

    def file_size(self) -> int:
        """Bytes of tensor data (F32), a close estimate of the file size."""
        return sum(4 * int(np.prod(shape)) for shape in self.tensors().values())


def _word_pieces() -> Iterator[str]:
    """Candidate vocabulary pieces, most useful first; each is a join of two earlier ones,
    so SentencePiece-style merging can reach every piece from characters."""
    singles = [chr(c) for c in range(33, 127)]
    yield SPACE
    yield from singles
    yield from (SPACE + c for c in ascii_lowercase)
    pairs = [a + b for a in ascii_lowercase for b in ascii_lowercase]
    yield from pairs
    yield from (SPACE + p for p in pairs)
    triples = [p + c for p in pairs for c in ascii_lowercase]
    yield from triples
    yield from (SPACE + t for t in triples)


def _piece_capacity() -> int:
    return 1 + 94 + 26 + 2 * 26**2 + 2 * 26**3


def vocabulary(size: int) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types of a `size`-token SentencePiece-style vocabulary."""
    tokens = list(SPECIALS)
    types = [TokenType.UNKNOWN, *[TokenType.CONTROL] * (len(SPECIALS) - 1)]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TokenType.BYTE] * 256
    scores = [0.0] * len(tokens)
    pieces = _word_pieces()
    while len(tokens) < size:
        tokens.append(next(pieces))
        types.append(TokenType.NORMAL)
        # SentencePiece merges the highest-scoring pair first: earlier pieces win.
        scores.append(-float(len(tokens)))
    return tokens, scores, [int(t) for t in types]


def _random(seed: int, index: int, shape: tuple[int, ...], std: float) -> np.ndarray:
    """One tensor's values: its own stream of the seed, so tensors do not depend on write order."""
    rng = np.random.default_rng([seed, index])
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)


def _weight(spec: ModelSpec, index: int, name: str, shape: tuple[int, ...], silent: list[int]) -> np.ndarray:
    if len(shape) == 1:
        # RMS-norm gains: 1 keeps activations at unit scale through every layer.
        return np.ones(shape, dtype=np.float32)
    if name == "output.weight":
        # Logits with a standard deviation of ~4: wide gaps between the top tokens.
        out = _random(spec.seed, index, shape, 4.0 / np.sqrt(shape[1]))
        out[silent] = 0.0
        return out
    if name == "token_embd.weight":
        return _random(spec.seed, index, shape, 1.0)
    return _random(spec.seed, index, shape, 1.0 / np.sqrt(shape[1]))


#: makes one tensor's values from its position in the file, name and shape
Maker = Callable[[int, str, tuple[int, ...]], np.ndarray]


def _write(writer: GGUFWriter, path: Path, shapes: dict[str, tuple[int, ...]], make: Maker) -> None:
    """Header and tensor table first, then each tensor as it is made (bounded memory)."""
    for name, shape in shapes.items():
        writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, (name, shape) in enumerate(shapes.items()):
        writer.write_tensor_data(make(index, name, shape))
    writer.close()


def write_model(path: Path, spec: ModelSpec = ModelSpec()) -> Path:
    """Write the model GGUF for `spec` to `path`; returns `path`."""
    spec.validate()
    tokens, scores, types = vocabulary(spec.vocab)
    writer = GGUFWriter(path, ARCH)
    writer.add_name(f"wakegate-tiny-{spec.layers}x{spec.dim}-s{spec.seed}")
    writer.add_file_type(LlamaFileType.ALL_F32)
    writer.add_vocab_size(spec.vocab)
    writer.add_context_length(spec.context)
    writer.add_embedding_length(spec.dim)
    writer.add_block_count(spec.layers)
    writer.add_feed_forward_length(spec.ffn)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.heads)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_dimension_count(spec.head_dim)
    # Ollama's default base differs from llama.cpp's; stating it keeps the engines equal.
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(UNK)
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(IM_END)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(True)
    writer.add_chat_template(CHAT_TEMPLATE)
    silent = [i for i, kind in enumerate(types) if kind != TokenType.NORMAL]
    _write(writer, path, spec.tensors(), lambda index, name, shape: _weight(spec, index, name, shape, silent))
    return path


#: the projections a generated adapter adapts (all of a llama block's linear layers)
LORA_TARGETS = llama.lora_targets("gguf")


def write_lora(path: Path, spec: ModelSpec = ModelSpec(), rank: int = 8, seed: int | None = None) -> Path:
    """Write a LoRA adapter GGUF for the model of `spec` to `path`; returns `path`.

    The adapter's own seed defaults to the model's plus one. Its update is as large
    as the weights it adapts (alpha = rank, so scale 1 applies it fully), which
    changes greedy output at scale 1 and leaves it alone at scale 0.
    """
    spec.validate()
    if rank < 1:
        raise ValueError(f"--lora-rank must be at least 1, not {rank}")
    lora_seed = spec.seed + 1 if seed is None else seed
    writer = GGUFWriter(path, ARCH)
    writer.add_type("adapter")
    writer.add_name(f"wakegate-tiny-lora-r{rank}-s{lora_seed}")
    writer.add_string(Keys.Adapter.TYPE, "lora")
    writer.add_float32(Keys.Adapter.LORA_ALPHA, float(rank))
    shapes: dict[str, tuple[int, ...]] = {}
    for name, (rows, cols) in ((n, s) for n, s in spec.tensors().items() if len(s) == 2):
        if name.split(".")[-2] in LORA_TARGETS:
            shapes[f"{name}.lora_a"] = (rank, cols)
            shapes[f"{name}.lora_b"] = (rows, rank)
    _write(writer, path, shapes, lambda index, _name, shape: _random(lora_seed, index, shape, 1.0 / np.sqrt(shape[1])))
    return path


def main(argv: list[str] | None = None) -> int:
    defaults = ModelSpec()
    parser = argparse.ArgumentParser(prog="python -m e2e.tinymodel", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the model GGUF to write")
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--dim", type=int, default=defaults.dim, help="model width (multiple of 16; of 64 from 256)")
    parser.add_argument("--vocab", type=int, default=defaults.vocab)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--context", type=int, default=defaults.context, help="trained context length")
    parser.add_argument("--lora-out", type=Path, help="also write a matching LoRA adapter GGUF here")
    parser.add_argument("--lora-rank", type=int, default=8)
    args = parser.parse_args(argv)
    spec = ModelSpec(layers=args.layers, dim=args.dim, vocab=args.vocab, seed=args.seed, context=args.context)
    try:
        spec.validate()
    except ValueError as exc:
        parser.error(str(exc))
    write_model(args.out, spec)
    print(f"model: {args.out} ({args.out.stat().st_size / 1e6:.1f} MB)")
    if args.lora_out is not None:
        write_lora(args.lora_out, spec, rank=args.lora_rank)
        print(f"lora: {args.lora_out} ({args.lora_out.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
