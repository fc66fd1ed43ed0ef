"""Digests of model files: the whole-file digest an artifact names, and a block table for fast checks.

Pure (hashlib only). A registry names every layer by the SHA-256 of its bytes, and that digest
can only be computed in order, on one core: about 0.9-1.1 GB/s on this machine, slower than the
disk. So while a file's bytes are verified against the digest the artifact names, the same bytes
are also hashed per block (`BLOCK_SIZE`), and the cache's readiness marker keeps those block
digests. Later checks (`wakegate flash-load`, a corruption check before an engine starts) hash
the blocks on as many threads as there are, and any changed byte fails its block's digest. The
block table is exactly as trustworthy as the marker it is stored in, which sits beside the files
it describes: it detects corruption, not an attacker who can write the cache.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

from wakegate.control.delivery.errors import DigestMismatch

#: bytes per block of the block table: 32 MiB gives a few hundred-MB model a dozen blocks to spread
#: over threads, and a multi-GB one a few hundred marker lines
BLOCK_SIZE = 32 * 1024 * 1024


def digest_of(data: bytes | memoryview, algorithm: str = "sha256") -> str:
    """`ALGORITHM:HEX` of bytes in memory."""
    return f"{algorithm}:" + hashlib.new(algorithm, data).hexdigest()


def new_hash(digest: str) -> hashlib._Hash:
    """A hash object of the algorithm `digest` names (sha256 or sha512)."""
    algorithm = digest.partition(":")[0]
    if algorithm not in ("sha256", "sha512"):
        raise ValueError(f"digest algorithm {algorithm!r} is not supported")
    return hashlib.new(algorithm)


def block_ranges(size: int, block_size: int = BLOCK_SIZE) -> Iterator[tuple[int, int]]:
    """(offset, length) of each block of a file of `size` bytes; none for an empty file."""
    for offset in range(0, size, block_size):
        yield offset, min(block_size, size - offset)


@dataclass(frozen=True)
class FileDigests:
    digest: str
    """`ALGORITHM:HEX` of the whole file."""
    size: int
    blocks: tuple[str, ...]
    """SHA-256 hex of each `block_size` block, in order."""
    block_size: int = BLOCK_SIZE


class Digester:
    """Feeds bytes, in order, to the whole-file hash and to the block table at once."""

    def __init__(self, algorithm_of: str = "sha256:", block_size: int = BLOCK_SIZE) -> None:
        self._whole = new_hash(algorithm_of)
        self._algorithm = algorithm_of.partition(":")[0]
        self._block_size = block_size
        self._block = hashlib.sha256()
        self._in_block = 0
        self._blocks: list[str] = []
        self.size = 0

    def update(self, data: bytes | memoryview) -> None:
        self.update_whole(data)
        self.update_blocks(data)

    def update_whole(self, data: bytes | memoryview) -> None:
        """The whole-file hash only (with `update_blocks`, the two may run on two threads)."""
        self._whole.update(data)
        self.size += len(data)

    def update_blocks(self, data: bytes | memoryview) -> None:
        """The block table only."""
        view = memoryview(data)
        while view:
            take = min(len(view), self._block_size - self._in_block)
            self._block.update(view[:take])
            self._in_block += take
            view = view[take:]
            if self._in_block == self._block_size:
                self._blocks.append(self._block.hexdigest())
                self._block = hashlib.sha256()
                self._in_block = 0

    def result(self) -> FileDigests:
        blocks = [*self._blocks, self._block.hexdigest()] if self._in_block else list(self._blocks)
        return FileDigests(f"{self._algorithm}:{self._whole.hexdigest()}", self.size, tuple(blocks), self._block_size)

    def verify(self, expected: str, what: str) -> FileDigests:
        """The digests, or DigestMismatch when the whole-file digest is not `expected`."""
        result = self.result()
        if result.digest != expected:
            raise DigestMismatch(f"{what}: digest is {result.digest}, expected {expected}")
        return result
