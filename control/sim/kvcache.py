"""The simulator's prefix cache: vLLM's automatic prefix caching, reduced to what routing feels.

Model (*pure*: no I/O, no clock)
--------------------------------
* A prompt is a list of tokens (the sim's tokens are whitespace-separated words, see
  :mod:`wakegate.control.sim.app`). Tokens are grouped into blocks of :data:`BLOCK_TOKENS`; each
  *full* block is identified by a chained hash: ``hash(parent hash, the block's tokens)``, so a
  block hash names the whole prefix up to and including that block (:func:`block_hashes`, shared
  with extproc's precise scorer through :mod:`wakegate.kvevents`). A partial last block is
  never shared.
* The cache holds ``capacity`` blocks. A block is *in use* while a running request references it
  (``refs > 0``), *cached* when no request references it but its contents are kept for reuse, or
  empty. Cached blocks are evicted least recently freed first, and a request frees its blocks
  tail first, so the end of a prompt goes before its shared beginning (as vLLM's free queue does).
* A request asks for the longest run of leading full blocks that are present (in use or cached);
  at most ``(prompt_tokens - 1) // BLOCK_TOKENS`` blocks can hit, because the engine must compute
  at least one prompt token to produce the first output token. It then needs
  ``ceil((prompt + output) / BLOCK_TOKENS) - hits`` further blocks; if those cannot be found among
  empty and evictable cached blocks, it waits. Its new full prompt blocks are cached from the
  moment they are allocated (vLLM caches them once computed; the difference is one prefill).
* When a request ends, its full blocks of prompt *and* output are cached (a multi-turn chat that
  re-sends the answer hits it), everything else it held becomes empty.
* Counters follow vLLM's: ``queries`` counts prompt tokens looked up, ``hits`` the tokens found;
  usage is in-use blocks over capacity (cached blocks are free memory to the engine).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from wakegate.kvevents import BLOCK_TOKENS, ROOT, block_hashes

__all__ = ["BLOCK_TOKENS", "ROOT", "Allocation", "KVCache", "block_hashes", "blocks_for"]


def blocks_for(tokens: int) -> int:
    """Blocks needed to hold ``tokens`` tokens."""
    return -(-tokens // BLOCK_TOKENS)


class Allocation:
    """The blocks one running request holds.

    ``hashed``: cached blocks it references, in chain order (prompt blocks; hits first);
    ``total``: blocks it holds in all (hashed ones included); ``hit_tokens``: prompt tokens found
    in the cache when it was admitted; ``extra``: output blocks hashed when it ended (filled by
    :meth:`KVCache.release`).
    """

    __slots__ = ("extra", "hashed", "hit_tokens", "total")

    def __init__(self, hashed: list[bytes], total: int, hit_tokens: int) -> None:
        self.hashed = hashed
        self.total = total
        self.hit_tokens = hit_tokens
        self.extra: list[bytes] = []


class KVCache:
    """Block accounting with prefix reuse and LRU eviction of unreferenced blocks.

    ``on_stored(hashes, parent)`` and ``on_removed(hashes)`` (optional) are told whenever block
    hashes enter or leave the cache, in the order of the chain; they back the KV events.
    """

    __slots__ = ("_cached", "_refs", "capacity", "hits", "on_removed", "on_stored", "queries", "used")

    def __init__(
        self,
        capacity: int,
        on_stored: Callable[[list[bytes], bytes | None], None] | None = None,
        on_removed: Callable[[list[bytes]], None] | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 block, got {capacity!r}")
        self.capacity = capacity
        self.used = 0  # physical blocks referenced by running requests (a shared block once)
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # prompt tokens found
        self._refs: dict[bytes, int] = {}  # in-use hashed blocks -> references
        self._cached: OrderedDict[bytes, None] = OrderedDict()  # unreferenced, least recently freed first
        self.on_stored = on_stored
        self.on_removed = on_removed

    @property
    def usage(self) -> float:
        """In-use blocks over capacity, 0..1."""
        return min(1.0, self.used / self.capacity)

    def __contains__(self, block: bytes) -> bool:
        return block in self._refs or block in self._cached

    def cached_blocks(self) -> list[bytes]:
        """Unreferenced cached blocks, next to be evicted first."""
        return list(self._cached)

    def match(self, hashes: Sequence[bytes], prompt_tokens: int) -> int:
        """How many leading blocks of ``hashes`` would hit (capped so one prompt token is computed)."""
        limit = min(len(hashes), max(0, (prompt_tokens - 1) // BLOCK_TOKENS))
        n = 0
        refs, cached = self._refs, self._cached
        while n < limit and (hashes[n] in refs or hashes[n] in cached):
            n += 1
        return n

    def fits(self, total: int) -> bool:
        """Whether a request holding ``total`` blocks could ever run here."""
        return total <= self.capacity

    def allocate(self, hashes: Sequence[bytes], prompt_tokens: int, total: int) -> Allocation | None:
        """Admit a request: ``hashes`` are its prompt's full blocks, ``total`` the blocks it needs.

        Returns None (and changes nothing) when the blocks cannot be found right now; counts the
        query only when it succeeds, so a waiting request is counted once, when it runs.
        """
        if not hashes:  # a prompt shorter than one block: nothing to look up or store
            if total > self.capacity - self.used:
                if total > self.capacity - self.used + len(self._cached):
                    return None
            else:
                self.used += total
                self.queries += prompt_tokens
                return Allocation([], total, 0)
        hits = self.match(hashes, prompt_tokens)
        hit_cached = sum(1 for h in hashes[:hits] if h in self._cached)
        new = total - hits
        if new > self.capacity - self.used - hit_cached:
            return None
        refs, cached = self._refs, self._cached
        for h in hashes[:hits]:
            if h in cached:
                del cached[h]
                refs[h] = 1
            else:
                refs[h] += 1
        self.used += new + hit_cached  # physical blocks: a shared block counts once
        # evict until the new blocks fit among the empty ones
        empty = self.capacity - self.used - len(cached)
        if empty < 0:
            evicted = [cached.popitem(last=False)[0] for _ in range(-empty)]
            if self.on_removed is not None:
                self.on_removed(evicted)
        # a block can be present past the hit cap only (a prompt of whole blocks): it is computed
        # again into a block of its own that stays anonymous
        stored = [h for h in hashes[hits:] if h not in refs and h not in cached]
        for h in stored:
            refs[h] = 1
        if stored and self.on_stored is not None:
            self.on_stored(stored, hashes[hits - 1] if hits else None)
        self.queries += prompt_tokens
        self.hits += hits * BLOCK_TOKENS
        return Allocation(hashed=[*hashes[:hits], *stored], total=total, hit_tokens=hits * BLOCK_TOKENS)

    def release(self, alloc: Allocation, output_hashes: Sequence[bytes] = ()) -> None:
        """A request ended: its blocks (and ``output_hashes``, its full output blocks) become cached.

        Blocks are queued for eviction tail first. Output blocks already cached elsewhere are not
        duplicated; output blocks beyond what the request held are ignored.
        """
        refs, cached = self._refs, self._cached
        room = alloc.total - len(alloc.hashed)  # anonymous blocks the request held
        extra: list[bytes] = []
        for h in output_hashes:
            if room <= 0:
                break
            if h in refs or h in cached:
                continue
            extra.append(h)
            room -= 1
        if extra and self.on_stored is not None:
            self.on_stored(extra, alloc.hashed[-1] if alloc.hashed else None)
        alloc.extra = extra
        self.used -= alloc.total - len(alloc.hashed)
        for h in reversed(extra):
            cached[h] = None
        for h in reversed(alloc.hashed):
            n = refs[h]
            if n > 1:
                refs[h] = n - 1
            else:
                del refs[h]
                cached[h] = None
                self.used -= 1

    def forget(self) -> None:
        """Drop every cached block no request holds (a sleeping engine discards its KV cache)."""
        if not self._cached:
            return
        gone = list(self._cached)
        self._cached.clear()
        if self.on_removed is not None:
            self.on_removed(gone)
