"""Precise prefix knowledge: which KV blocks each endpoint's engine says it holds (*pure*).

:class:`KVIndex` is fed the engines' KV events (vLLM's ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``, decoded by :mod:`wakegate.kvevents`; read off the wire by
:mod:`wakegate.extproc.kvsubscriber`) and answers, for a request's block-hash chain
(:func:`wakegate.kvevents.body_blocks`), how many leading blocks each endpoint holds.

Memory is bounded per endpoint (:data:`ENDPOINT_BLOCKS`, least recently stored dropped first).
Every error the index can make is on the safe side, an endpoint holding *more* than it is
credited with, except a missed ``BlockRemoved``; so whenever events may have been missed the
endpoint's blocks are dropped (:meth:`KVIndex.reset`) and knowledge rebuilds from what follows:

* a batch whose sequence number skips ahead is a **gap** (the subscriber asks the engine's
  replay socket for the missing batches first, and resets only when they cannot all be had);
* a sequence number that does not move forward is a **restart** of the publisher (a restarted
  engine counts from 0 again, and its cache is empty);
* ``AllBlocksCleared`` drops the endpoint's blocks; an endpoint that leaves the route table is
  forgotten entirely (:meth:`KVIndex.retain`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from wakegate.extproc.prefix import PrefixIndex
from wakegate.kvevents import AllCleared, Event, Removed, Stored

__all__ = ["ENDPOINT_BLOCKS", "KVIndex", "Target", "Verdict", "target_for"]

ENDPOINT_BLOCKS = 65536
"""Block hashes kept per endpoint (a million tokens of KV cache at 16 tokens a block)."""

Verdict = Literal["first", "next", "gap", "restart"]


@dataclass(frozen=True, slots=True)
class Target:
    """Where one endpoint's engine publishes (``events``) and answers replay requests (``replay``)."""

    events: str
    replay: str | None = None


def target_for(address: str, port: int, offset: int, replay_offset: int = 0) -> Target:
    """The ZMQ addresses of an engine at ``address:port`` that publishes on its port plus ``offset``."""
    host = f"[{address}]" if ":" in address else address
    replay = f"tcp://{host}:{port + replay_offset}" if replay_offset else None
    return Target(f"tcp://{host}:{port + offset}", replay)


class KVIndex:
    """Per-endpoint block sets kept from KV-event batches, with their sequence numbers."""

    __slots__ = ("_block_size", "_blocks", "_seq", "gaps", "restarts")

    def __init__(self, capacity: int = ENDPOINT_BLOCKS) -> None:
        self._blocks = PrefixIndex(capacity)
        self._seq: dict[str, int] = {}  # endpoint -> last batch applied
        self._block_size: dict[str, int] = {}  # endpoint -> tokens per block its events last said
        self.gaps = 0  # resets after batches were lost for good
        self.restarts = 0  # publishers seen counting again

    def last(self, endpoint: str) -> int | None:
        """The last batch applied for ``endpoint``, or None before its first."""
        return self._seq.get(endpoint)

    def blocks(self, endpoint: str) -> int:
        """How many blocks ``endpoint`` is known to hold."""
        return self._blocks.blocks(endpoint)

    def held(self, endpoint: str) -> set[Hashable]:
        """The blocks ``endpoint`` is known to hold (a copy)."""
        return self._blocks.held(endpoint)

    def check(self, endpoint: str, seq: int) -> Verdict:
        """What batch ``seq`` is for ``endpoint``: its first, the next, past a gap, or a restart."""
        last = self._seq.get(endpoint)
        if last is None:
            return "first"
        if seq == last + 1:
            return "next"
        return "gap" if seq > last else "restart"

    def apply(self, endpoint: str, seq: int, events: Sequence[Event]) -> None:
        """Apply batch ``seq`` (the caller has settled that it is the one to apply now)."""
        blocks = self._blocks
        for event in events:
            if isinstance(event, Stored):
                blocks.record(endpoint, event.hashes)
                self._block_size[endpoint] = event.block_size
            elif isinstance(event, Removed):
                blocks.discard(endpoint, event.hashes)
            elif isinstance(event, AllCleared):
                blocks.forget(endpoint)
        self._seq[endpoint] = seq

    def reset(self, endpoint: str, *, restart: bool = False) -> None:
        """Drop ``endpoint``'s blocks: events were lost (or its engine restarted); tracking goes on."""
        self._blocks.forget(endpoint)
        if restart:
            self.restarts += 1
        else:
            self.gaps += 1

    def forget(self, endpoint: str) -> None:
        """Drop everything about ``endpoint`` (it left the route table)."""
        self._blocks.forget(endpoint)
        self._seq.pop(endpoint, None)
        self._block_size.pop(endpoint, None)

    def retain(self, endpoints: Iterable[str]) -> None:
        """Forget every endpoint not in ``endpoints``."""
        keep = set(endpoints)
        for ep in [ep for ep in self._seq if ep not in keep]:
            self.forget(ep)
        self._blocks.retain(keep)

    def block_size(self, endpoints: Iterable[str]) -> int | None:
        """Tokens per block of the first of ``endpoints`` whose engine reported storing any (the
        replicas of one model share their engine's block size), or None before any did."""
        sizes = self._block_size
        for ep in endpoints:
            size = sizes.get(ep)
            if size:
                return size
        return None

    def matches(self, chain: Sequence[Hashable]) -> dict[str, int]:
        """Endpoint -> leading blocks of ``chain`` it holds (endpoints holding none left out)."""
        return self._blocks.matches(chain)
