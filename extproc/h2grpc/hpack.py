"""HPACK (RFC 7541) for the HTTP/2 server: decoding what a client sends, encoding what we send.

Why not `hpack.Decoder`: it logs at debug level for every header field and decodes every
Huffman string again, and Envoy sends the same few strings on every stream (the method path
is a Huffman literal each time). Short Huffman strings are decoded once and remembered (a
bounded cache); the dynamic table follows the encoder's updates, bounded by the 4,096 bytes
we allow (we never raise SETTINGS_HEADER_TABLE_SIZE). Huffman decoding itself and the
static table come from the `hpack` package (its private modules, hence the upper bound on that dependency).

The work a client can ask for is bounded: a block's decoded size by the header list limit,
and Huffman decoding (about 0.3 µs a byte in Python, the costly part) by a limit per block
and a budget per connection, which the connection refills as streams open.

What we send is encoded as literals that never touch the dynamic table, so nothing there
can go out of step with the client.
"""

from __future__ import annotations

from collections import deque

from hpack.exceptions import HPACKDecodingError
from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

_STATIC_TABLE: tuple[tuple[bytes, bytes], ...] = tuple(HeaderTable.STATIC_TABLE)
#: Per-field overhead RFC 7541 §4.1 adds to name and value lengths.
_FIELD_OVERHEAD = 32
#: Largest header list (RFC 7541 sizes) a client may send us; advertised in our SETTINGS.
MAX_HEADER_LIST_SIZE = 64 * 1024


class HpackError(Exception):
    """A header block that cannot be decoded (a compression error), or one past a limit."""

    def __init__(self, reason: str, *, too_large: bool = False, costly: bool = False) -> None:
        super().__init__(reason)
        #: past the header list size
        self.too_large = too_large
        #: past the Huffman work allowed per block or per connection
        self.costly = costly


class HeaderDecoder:
    """Decodes the header blocks of one client connection, in order."""

    MAX_TABLE_SIZE = 4096
    _CACHE_LIMIT = 512
    #: Huffman strings up to this many (coded) bytes are remembered: 512 of them stay small.
    _CACHE_STRING = 128

    def __init__(
        self,
        max_header_list_size: int = MAX_HEADER_LIST_SIZE,
        *,
        huffman_per_block: int = 16 * 1024,
        huffman_budget: int = 64 * 1024,
    ) -> None:
        self.max_header_list_size = max_header_list_size
        self.huffman_per_block = huffman_per_block
        #: Huffman-coded bytes this decoder may still decode (not counting cached strings);
        #: its owner tops it up.
        self.huffman_budget = huffman_budget
        self._block_huffman = 0
        self._table: deque[tuple[bytes, bytes]] = deque()
        self._size = 0
        self._max_size = self.MAX_TABLE_SIZE
        self._huffman: dict[bytes, bytes] = {}

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        headers: list[tuple[bytes, bytes]] = []
        self._block_huffman = 0
        pos = 0
        end = len(block)
        total = 0
        while pos < end:
            first = block[pos]
            if first & 0x80:  # indexed field
                index, pos = read_int(block, pos, 7)
                name, value = self._entry(index)
            elif first & 0x40:  # literal with incremental indexing
                index, pos = read_int(block, pos, 6)
                name, value, pos = self._literal(block, pos, index)
                self._add(name, value)
            elif first & 0x20:  # dynamic table size update
                size, pos = read_int(block, pos, 5)
                if size > self.MAX_TABLE_SIZE:
                    raise HpackError(f"table size {size} above {self.MAX_TABLE_SIZE}")
                if headers:
                    raise HpackError("table size update after a header field")
                self._max_size = size
                self._evict()
                continue
            else:  # literal without indexing / never indexed
                index, pos = read_int(block, pos, 4)
                name, value, pos = self._literal(block, pos, index)
            total += len(name) + len(value) + _FIELD_OVERHEAD
            if total > self.max_header_list_size:
                raise HpackError("header list too large", too_large=True)
            headers.append((name, value))
        return headers

    def _entry(self, index: int) -> tuple[bytes, bytes]:
        if index == 0:
            raise HpackError("header index 0")
        if index <= len(_STATIC_TABLE):
            return _STATIC_TABLE[index - 1]
        dynamic = index - len(_STATIC_TABLE) - 1
        if dynamic >= len(self._table):
            raise HpackError(f"header index {index} out of range")
        return self._table[dynamic]

    def _literal(self, block: bytes, pos: int, index: int) -> tuple[bytes, bytes, int]:
        if index:
            name = self._entry(index)[0]
        else:
            name, pos = self._string(block, pos)
        value, pos = self._string(block, pos)
        return name, value, pos

    def _string(self, block: bytes, pos: int) -> tuple[bytes, int]:
        if pos >= len(block):
            raise HpackError("header block ends inside a field")
        huffman = block[pos] & 0x80
        length, pos = read_int(block, pos, 7)
        end = pos + length
        if end > len(block):
            raise HpackError("header string runs past the block")
        raw = block[pos:end]
        if not huffman:
            return raw, end
        decoded = self._huffman.get(raw)
        if decoded is None:
            self._block_huffman += length
            if self._block_huffman > self.huffman_per_block:
                raise HpackError(f"more than {self.huffman_per_block} Huffman-coded bytes in a block", costly=True)
            self.huffman_budget -= length
            if self.huffman_budget < 0:
                raise HpackError("Huffman decoding budget spent", costly=True)
            try:
                decoded = decode_huffman(raw)
            except HPACKDecodingError as exc:
                raise HpackError(f"bad Huffman string: {exc}") from None
            if length <= self._CACHE_STRING:
                if len(self._huffman) >= self._CACHE_LIMIT:
                    self._huffman.clear()
                self._huffman[raw] = decoded
        return decoded, end

    def _add(self, name: bytes, value: bytes) -> None:
        size = len(name) + len(value) + _FIELD_OVERHEAD
        if size > self._max_size:
            self._table.clear()
            self._size = 0
            return
        self._table.appendleft((name, value))
        self._size += size
        self._evict()

    def _evict(self) -> None:
        while self._size > self._max_size:
            name, value = self._table.pop()
            self._size -= len(name) + len(value) + _FIELD_OVERHEAD


def read_int(block: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
    """An HPACK integer with an N-bit prefix starting at block[pos]; returns (value, next pos)."""
    limit = (1 << prefix_bits) - 1
    value = block[pos] & limit
    pos += 1
    if value < limit:
        return value, pos
    shift = 0
    while True:
        if pos >= len(block) or shift > 28:
            raise HpackError("bad HPACK integer")
        byte = block[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def encode_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes, value: bytes) -> bytes:
    """One header as a literal without indexing, with a literal name (no Huffman)."""
    return b"\x00" + encode_int(len(name), 7) + name + encode_int(len(value), 7) + value


#: The static table's `:status: 200` (index 8), as one indexed field.
STATUS_200 = b"\x88"
