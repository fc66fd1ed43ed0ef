"""Approximate prefix affinity: which endpoint recently got which prompt prefix (*pure*).

The gateway does not know a model's tokenizer, so it cuts the prompt's text into blocks of
:data:`BLOCK_CHARS` characters (about 256 tokens of English) and chains their hashes: block ``i``'s
hash covers the whole text up to the end of block ``i``, the way an engine's KV blocks are named.
A partial last block is ignored, and at most :data:`MAX_BLOCKS` blocks are hashed, so a prompt
costs at most ``BLOCK_CHARS * MAX_BLOCKS`` characters of hashing however long it is (262 144
characters, about 64k tokens).

:class:`PrefixIndex` remembers, per endpoint, the block hashes of the requests routed there
(bounded LRU per endpoint), and answers "how many leading blocks of this chain went to each
endpoint" in one walk of the chain. It learns only from the gateway's own picks: it is a guess of
what each engine caches, which is right as long as the engine's cache is at least as large as
the index's bound and nothing else sends traffic there. Several gateways each learn from their
own traffic (eventually consistent at best; each converges on its own). An endpoint that goes
away is forgotten (:meth:`PrefixIndex.retain`); one that restarts under the same address keeps
its stale entries until they age out, so the first requests after a restart may be sent to an
engine whose cache is empty, and the load scorers then see it busy or idle like any other.

Hashes use Python's ``hash()`` of (parent, text) tuples: the index lives in one process and
is never shared or persisted, so the per-process hash seed does not matter, and it is the cheapest
stable-within-a-process string hash CPython has.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

__all__ = ["BLOCK_CHARS", "MAX_BLOCKS", "PrefixIndex", "chain", "prompt_text"]

BLOCK_CHARS = 1024
"""Characters per block of the approximate index."""

MAX_BLOCKS = 256
"""Blocks hashed at most per prompt."""

ENDPOINT_BLOCKS = 16384
"""Block hashes remembered per endpoint (16 M characters of prompt, ~4 M tokens)."""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
        )
    return ""


def _role(role: Any) -> str:
    return role if isinstance(role, str) else ""


def prompt_text(body: Mapping[str, Any] | None, limit: int = BLOCK_CHARS * MAX_BLOCKS) -> str:
    """The prompt as one string: chat messages as ``role \\x1f text`` joined by ``\\x1e``,
    or a completion's ``prompt`` (a string, or the first of a list of strings). ``""`` if none.
    Messages past the first ``limit`` characters are not read (the result may be longer)."""
    if body is None:
        return ""
    messages = body.get("messages")
    if isinstance(messages, list):
        pieces: list[str] = []
        size = 0
        for m in messages:  # stop once the hashed part is covered: a huge history costs no more
            if size >= limit:
                break
            if isinstance(m, Mapping):
                piece = f"{_role(m.get('role'))}\x1f{_content_text(m.get('content'))}"
                pieces.append(piece)
                size += len(piece) + 1
        return "\x1e".join(pieces)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else ""


def chain(text: str, block_chars: int = BLOCK_CHARS, max_blocks: int = MAX_BLOCKS) -> list[int]:
    """Chained hashes of the full blocks of ``text`` (at most ``max_blocks``)."""
    n = min(len(text) // block_chars, max_blocks)
    out: list[int] = []
    prev = 0
    for i in range(0, n * block_chars, block_chars):
        prev = hash((prev, text[i : i + block_chars]))
        out.append(prev)
    return out


class PrefixIndex:
    """Per-endpoint LRU sets of block hashes, and which endpoints hold each hash.

    Hashes are any hashable values: this module's integer chains, or the byte strings of an
    engine's KV events (:mod:`wakegate.extproc.kvindex`).
    """

    __slots__ = ("_lru", "_owners", "capacity")

    def __init__(self, capacity: int = ENDPOINT_BLOCKS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        self.capacity = capacity
        self._lru: dict[str, OrderedDict[Hashable, None]] = {}
        self._owners: dict[Hashable, dict[str, None]] = {}

    def __len__(self) -> int:
        return len(self._owners)

    def blocks(self, endpoint: str) -> int:
        """How many block hashes ``endpoint`` is remembered to hold."""
        lru = self._lru.get(endpoint)
        return len(lru) if lru is not None else 0

    def held(self, endpoint: str) -> set[Hashable]:
        """The block hashes ``endpoint`` is remembered to hold (a copy)."""
        return set(self._lru.get(endpoint, ()))

    def matches(self, hashes: Sequence[Hashable]) -> dict[str, int]:
        """Endpoint -> how many leading blocks of ``hashes`` it holds (endpoints with none left out).

        Walks the chain once and stops when no endpoint holds the next block, so the cost is
        O(matched blocks x endpoints holding them), not O(chain x endpoints).
        """
        owners = self._owners
        out: dict[str, int] = {}
        alive: list[str] = []
        depth = 0
        for h in hashes:
            holders = owners.get(h)
            if not holders:
                break
            if not depth:
                alive = list(holders)
            elif len(alive) == 1:
                if alive[0] not in holders:
                    break
            else:
                still = [ep for ep in alive if ep in holders]
                if not still:
                    break
                for ep in alive:
                    if ep not in holders:
                        out[ep] = depth
                alive = still
            depth += 1
        for ep in alive:
            out[ep] = depth
        return out

    def record(self, endpoint: str, hashes: Sequence[Hashable]) -> None:
        """``endpoint`` got a request with this chain: remember its blocks (most recent last)."""
        if not hashes:
            return
        lru = self._lru.get(endpoint)
        if lru is None:
            lru = self._lru[endpoint] = OrderedDict()
        owners = self._owners
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            holders = owners.get(h)
            if holders is None:
                owners[h] = {endpoint: None}
            else:
                holders[endpoint] = None
        excess = len(lru) - self.capacity
        for _ in range(excess if excess > 0 else 0):
            old, _none = lru.popitem(last=False)
            self._drop(old, endpoint)

    def discard(self, endpoint: str, hashes: Iterable[Hashable]) -> None:
        """``endpoint`` no longer holds these blocks (unknown ones are ignored)."""
        lru = self._lru.get(endpoint)
        if lru is None:
            return
        for h in hashes:
            if h in lru:
                del lru[h]
                self._drop(h, endpoint)

    def _drop(self, h: Hashable, endpoint: str) -> None:
        holders = self._owners.get(h)
        if holders is not None:
            holders.pop(endpoint, None)
            if not holders:
                del self._owners[h]

    def forget(self, endpoint: str) -> None:
        """Drop everything remembered about ``endpoint`` (it went away)."""
        lru = self._lru.pop(endpoint, None)
        if lru is not None:
            for h in lru:
                self._drop(h, endpoint)

    def retain(self, endpoints: Iterable[str]) -> None:
        """Forget every endpoint not in ``endpoints``."""
        keep = set(endpoints)
        for ep in [ep for ep in self._lru if ep not in keep]:
            self.forget(ep)
