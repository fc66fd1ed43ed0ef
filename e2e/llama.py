"""A Llama-architecture model's tensors: one table of what each one is, with the two names the
generators write it under (GGUF's, for e2e/tinymodel.py; transformers' `LlamaForCausalLM`, for
e2e/hfmodel.py).

Shapes are numpy's (rows = outputs): a projection from the width to the feed-forward width is
`(ffn, dim)`. Which tensors a LoRA adapter adapts is part of the table too (every linear layer of a
block), so both generators' adapters cover the same layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Naming = Literal["gguf", "hf"]
Size = Literal["dim", "ffn", "vocab"]


@dataclass(frozen=True)
class Tensor:
    """One tensor of the layout; block tensors' names take the block's index as `{i}`."""

    gguf: str
    hf: str
    rows: Size
    cols: Size | None = None
    """None: a vector (the RMS norms' gains)."""
    adapted: bool = False
    """A generated LoRA adapter adapts it."""

    def name(self, naming: Naming, block: int = 0) -> str:
        return (self.gguf if naming == "gguf" else self.hf).format(i=block)

    def module(self, naming: Naming) -> str:
        """The layer's short name (`attn_q`, `q_proj`): what adapters' target lists say."""
        return self.name(naming).split(".")[-2]


EMBEDDING = Tensor("token_embd.weight", "model.embed_tokens.weight", "vocab", "dim")
#: one transformer block, in file order
BLOCK = (
    Tensor("blk.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight", "dim"),
    Tensor("blk.{i}.attn_q.weight", "model.layers.{i}.self_attn.q_proj.weight", "dim", "dim", adapted=True),
    Tensor("blk.{i}.attn_k.weight", "model.layers.{i}.self_attn.k_proj.weight", "dim", "dim", adapted=True),
    Tensor("blk.{i}.attn_v.weight", "model.layers.{i}.self_attn.v_proj.weight", "dim", "dim", adapted=True),
    Tensor("blk.{i}.attn_output.weight", "model.layers.{i}.self_attn.o_proj.weight", "dim", "dim", adapted=True),
    Tensor("blk.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight", "dim"),
    Tensor("blk.{i}.ffn_gate.weight", "model.layers.{i}.mlp.gate_proj.weight", "ffn", "dim", adapted=True),
    Tensor("blk.{i}.ffn_up.weight", "model.layers.{i}.mlp.up_proj.weight", "ffn", "dim", adapted=True),
    Tensor("blk.{i}.ffn_down.weight", "model.layers.{i}.mlp.down_proj.weight", "dim", "ffn", adapted=True),
)
NORM = Tensor("output_norm.weight", "model.norm.weight", "dim")
OUTPUT = Tensor("output.weight", "lm_head.weight", "vocab", "dim")


class Shape:
    """What the generators' specs share: a model of `layers` blocks, `dim` wide, in heads of
    `head_dim` (each spec says how wide its heads are)."""

    layers: int
    dim: int

    @property
    def head_dim(self) -> int:
        raise NotImplementedError

    @property
    def heads(self) -> int:
        return self.dim // self.head_dim

    @property
    def ffn(self) -> int:
        return ffn_width(self.dim)

    def check_shape(self, dims: str) -> None:
        """A ValueError naming the flag when the blocks or the width cannot make a model; `dims`
        says which widths can (for the message)."""
        if self.layers < 1:
            raise ValueError(f"--layers must be at least 1, not {self.layers}")
        if self.dim < self.head_dim or self.dim % self.head_dim:
            raise ValueError(f"--dim must be {dims}, not {self.dim}")


def ffn_width(dim: int) -> int:
    """About 8/3 of the width, rounded up to a multiple of 32, as Llama models do."""
    return -(-8 * dim // 3 // 32) * 32


def shapes(naming: Naming, *, layers: int, dim: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, in file order."""
    sizes = {"dim": dim, "ffn": ffn_width(dim), "vocab": vocab}

    def shape(tensor: Tensor) -> tuple[int, ...]:
        if tensor.cols is None:
            return (sizes[tensor.rows],)
        return (sizes[tensor.rows], sizes[tensor.cols])

    out = {EMBEDDING.name(naming): shape(EMBEDDING)}
    for i in range(layers):
        out.update({tensor.name(naming, i): shape(tensor) for tensor in BLOCK})
    out[NORM.name(naming)] = shape(NORM)
    out[OUTPUT.name(naming)] = shape(OUTPUT)
    return out


def lora_targets(naming: Naming) -> tuple[str, ...]:
    """The layers a generated adapter adapts, by their short names."""
    return tuple(tensor.module(naming) for tensor in BLOCK if tensor.adapted)
