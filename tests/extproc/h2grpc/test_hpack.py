"""extproc's HPACK decoder against the `hpack` package's encoder, block after block."""

from __future__ import annotations

import contextlib

import hpack
import hpack.huffman
import pytest
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hypothesis import given, settings
from hypothesis import strategies as st

from wakegate.extproc.h2grpc.hpack import HeaderDecoder, HpackError

_CODES = (REQUEST_CODES, REQUEST_CODES_LENGTH)

_names = st.sampled_from(
    [b":method", b":path", b":authority", b"content-type", b"te", b"x-forwarded-for", b"grpc-timeout"]
) | st.binary(min_size=1, max_size=30).map(lambda b: b.lower().replace(b":", b"-"))
_values = st.binary(max_size=200)
_block = st.lists(st.tuples(_names, _values, st.booleans()), max_size=12)


@settings(max_examples=300, deadline=None)
@given(blocks=st.lists(_block, min_size=1, max_size=8), huffman=st.booleans(), table=st.sampled_from([0, 256, 4096]))
def test_decodes_what_hpack_encodes(blocks, huffman: bool, table: int) -> None:
    encoder = hpack.Encoder()
    encoder.header_table_size = table  # emits a table size update in the next block
    decoder = HeaderDecoder()
    for block in blocks:
        fields = [hpack.NeverIndexedHeaderTuple(n, v) if never else (n, v) for n, v, never in block]
        encoded = encoder.encode(fields, huffman=huffman)
        assert decoder.decode(encoded) == [(n, v) for n, v, _ in block]


def test_repeated_huffman_literal_decodes_the_same() -> None:
    encoder = hpack.Encoder()
    decoder = HeaderDecoder()
    path = b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"
    for _ in range(3):
        block = encoder.encode([hpack.NeverIndexedHeaderTuple(b":path", path)], huffman=True)
        assert decoder.decode(block) == [(b":path", path)]


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=64))
def test_garbage_is_a_protocol_error_never_a_crash(data: bytes) -> None:
    with contextlib.suppress(HpackError):  # any other exception fails the test
        HeaderDecoder().decode(data)


def test_table_size_above_the_limit_is_refused() -> None:
    with pytest.raises(HpackError):
        HeaderDecoder().decode(b"\x3f\xe1\x3f")  # size update to 8,192


def test_header_list_size_is_bounded() -> None:
    encoder = hpack.Encoder()
    block = encoder.encode([(b"x-big", b"v" * 70_000)], huffman=False)
    with pytest.raises(HpackError):
        HeaderDecoder().decode(block)


def _huffman_block(value: bytes) -> bytes:
    return hpack.Encoder().encode([(b"x-junk", value)], huffman=True)


def test_huffman_work_is_bounded_per_block() -> None:
    decoder = HeaderDecoder(huffman_per_block=1000, huffman_budget=10**9)
    assert decoder.decode(_huffman_block(b"a" * 1000))  # ~630 coded bytes
    with pytest.raises(HpackError) as err:
        decoder.decode(_huffman_block(b"b" * 2000))
    assert err.value.costly


def test_huffman_work_is_bounded_per_connection_and_cached_strings_are_free() -> None:
    path = b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"
    long = bytes(range(97, 123)) * 20
    short_cost, long_cost = (len(hpack.huffman.HuffmanEncoder(*_CODES).encode(v)) for v in (path, long))
    decoder = HeaderDecoder(huffman_budget=short_cost + 2 * long_cost + long_cost // 2)
    for _ in range(1000):  # remembered after the first time: no budget spent
        assert decoder.decode(_huffman_block(path))
    decoder.decode(_huffman_block(long))
    decoder.decode(_huffman_block(long))
    with pytest.raises(HpackError) as err:  # long strings are not cached: each one costs again
        decoder.decode(_huffman_block(long))
    assert err.value.costly
    decoder.huffman_budget += 10_000  # what the connection grants as streams open
    assert decoder.decode(_huffman_block(b"fine"))
