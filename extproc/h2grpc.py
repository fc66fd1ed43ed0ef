"""A small HTTP/2 server for the gRPC calls Envoy makes to extproc.

Why not grpcio's server: at one ext_proc stream per HTTP request, grpc.aio spends about
290 µs of CPU per stream on its own machinery before any of our code runs; this server
spends about 50 (docs/decisions.md, "ext_proc transport"). It speaks exactly what a gRPC
client needs over cleartext HTTP/2 (prior knowledge, no TLS, no compression):

* frames: DATA, HEADERS + CONTINUATION, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE;
  PRIORITY and unknown frame types are ignored, PUSH_PROMISE is a protocol error;
* HPACK decoding of what the client sends (Huffman through the `hpack` package); what we
  send is encoded as literals that never touch the dynamic table, so nothing there can go out of step;
* flow control both ways: we open our receive windows wide once and top the connection
  window up as it drains; what we send waits for the client's windows;
* gRPC framing: 5-byte length-prefixed messages, trailers with grpc-status and a
  percent-encoded grpc-message, trailers-only responses for calls refused up front;
* draining: two GOAWAYs (the first announces, a PING round trip later the second names the
  last stream we will serve), so streams already on the wire are not refused.

A call is served by a listener the method's factory returns. The server calls its
`on_message` for each whole request message, `on_half_close` when the client has sent
everything, and `on_cancel` once if the stream is reset or the connection is lost before
the call finished. The listener answers through its `Call`: `send()` then `finish()`. All
of this runs on the event loop thread, without a task per call: a listener that must wait
starts its own task.

A protocol error from the client ends its connection with GOAWAY and the error code; it
never affects other connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
import urllib.parse
from collections import deque
from collections.abc import Callable
from typing import Protocol, cast

from hpack.exceptions import HPACKDecodingError
from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

log = logging.getLogger("wakegate.extproc.h2")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types (RFC 9113 §6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
# Flags.
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
# Settings.
SETTINGS_HEADER_TABLE_SIZE = 0x1
SETTINGS_ENABLE_PUSH = 0x2
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
SETTINGS_MAX_FRAME_SIZE = 0x5
SETTINGS_MAX_HEADER_LIST_SIZE = 0x6
# Error codes.
NO_ERROR = 0x0
PROTOCOL_ERROR = 0x1
INTERNAL_ERROR = 0x2
FLOW_CONTROL_ERROR = 0x3
STREAM_CLOSED = 0x5
FRAME_SIZE_ERROR = 0x6
REFUSED_STREAM = 0x7
CANCEL = 0x8
COMPRESSION_ERROR = 0x9

# gRPC status codes used here.
OK = 0
CANCELLED = 1
UNKNOWN = 2
INVALID_ARGUMENT = 3
NOT_FOUND = 5
RESOURCE_EXHAUSTED = 8
UNIMPLEMENTED = 12
INTERNAL = 13
UNAVAILABLE = 14

MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65_535
DEFAULT_FRAME_SIZE = 16_384
#: Largest frame we accept; large bodies then arrive in few frames.
OUR_MAX_FRAME_SIZE = 1 << 20
MAX_HEADER_LIST_SIZE = 64 * 1024
#: Top the connection receive window up once this much of it has been used.
_WINDOW_REFILL = 1 << 30
_GOAWAY_PING = b"wg-drain"
_FRAME_HEADER = struct.Struct(">I")
_STATIC_TABLE: tuple[tuple[bytes, bytes], ...] = tuple(HeaderTable.STATIC_TABLE)


class ProtocolError(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class Listener(Protocol):
    def on_message(self, data: bytes) -> None: ...
    def on_half_close(self) -> None: ...
    def on_cancel(self) -> None: ...


#: Builds the listener of one call to a method.
Method = Callable[["Call"], Listener]


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return _FRAME_HEADER.pack(len(payload))[1:] + bytes((kind, flags)) + _FRAME_HEADER.pack(stream_id) + payload


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
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


def _literal(name: bytes, value: bytes) -> bytes:
    """One header as an HPACK literal without indexing, with a literal name (no Huffman)."""
    return b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value


def _grpc_message(text: str) -> bytes:
    # gRPC percent-encodes grpc-message as UTF-8; keep printable ASCII except '%'.
    return urllib.parse.quote(text, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode("ascii")


_RESPONSE_HEADERS = b"\x88" + _literal(b"content-type", b"application/grpc")  # 0x88: static ":status: 200"
_OK_TRAILERS = _literal(b"grpc-status", b"0")


def _trailers(status: int, message: str) -> bytes:
    block = _literal(b"grpc-status", str(status).encode())
    if message:
        block += _literal(b"grpc-message", _grpc_message(message))
    return block


class HeaderDecoder:
    """HPACK decoding (RFC 7541) of what one client sends on one connection.

    Why not `hpack.Decoder`: it logs at debug level for every header field and decodes
    every Huffman string again, and Envoy sends the same few strings on every stream
    (the method path is a Huffman literal each time). Huffman strings are decoded once
    and remembered; the dynamic table follows the encoder's updates, bounded by the
    4,096 bytes we allow (we never raise SETTINGS_HEADER_TABLE_SIZE).
    """

    MAX_TABLE_SIZE = 4096
    _CACHE_LIMIT = 512

    def __init__(self, max_header_list_size: int = MAX_HEADER_LIST_SIZE) -> None:
        self.max_header_list_size = max_header_list_size
        self._table: deque[tuple[bytes, bytes]] = deque()
        self._size = 0
        self._max_size = self.MAX_TABLE_SIZE
        self._huffman: dict[bytes, bytes] = {}

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        headers: list[tuple[bytes, bytes]] = []
        pos = 0
        end = len(block)
        total = 0
        while pos < end:
            first = block[pos]
            if first & 0x80:  # indexed field
                index, pos = _read_int(block, pos, 7)
                name, value = self._entry(index)
            elif first & 0x40:  # literal with incremental indexing
                index, pos = _read_int(block, pos, 6)
                name, value, pos = self._literal(block, pos, index)
                self._add(name, value)
            elif first & 0x20:  # dynamic table size update
                size, pos = _read_int(block, pos, 5)
                if size > self.MAX_TABLE_SIZE:
                    raise ProtocolError(COMPRESSION_ERROR, f"table size {size} above {self.MAX_TABLE_SIZE}")
                if headers:
                    raise ProtocolError(COMPRESSION_ERROR, "table size update after a header field")
                self._max_size = size
                self._evict()
                continue
            else:  # literal without indexing / never indexed
                index, pos = _read_int(block, pos, 4)
                name, value, pos = self._literal(block, pos, index)
            total += len(name) + len(value) + 32
            if total > self.max_header_list_size:
                raise ProtocolError(PROTOCOL_ERROR, "header list too large")
            headers.append((name, value))
        return headers

    def _entry(self, index: int) -> tuple[bytes, bytes]:
        if index == 0:
            raise ProtocolError(COMPRESSION_ERROR, "header index 0")
        if index <= len(_STATIC_TABLE):
            return _STATIC_TABLE[index - 1]
        dynamic = index - len(_STATIC_TABLE) - 1
        if dynamic >= len(self._table):
            raise ProtocolError(COMPRESSION_ERROR, f"header index {index} out of range")
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
            raise ProtocolError(COMPRESSION_ERROR, "header block ends inside a field")
        huffman = block[pos] & 0x80
        length, pos = _read_int(block, pos, 7)
        end = pos + length
        if end > len(block):
            raise ProtocolError(COMPRESSION_ERROR, "header string runs past the block")
        raw = block[pos:end]
        if not huffman:
            return raw, end
        decoded = self._huffman.get(raw)
        if decoded is None:
            try:
                decoded = decode_huffman(raw)
            except HPACKDecodingError as exc:
                raise ProtocolError(COMPRESSION_ERROR, f"bad Huffman string: {exc}") from None
            if len(self._huffman) >= self._CACHE_LIMIT:
                self._huffman.clear()
            self._huffman[raw] = decoded
        return decoded, end

    def _add(self, name: bytes, value: bytes) -> None:
        size = len(name) + len(value) + 32
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
            self._size -= len(name) + len(value) + 32


def _read_int(block: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
    """An HPACK integer with an N-bit prefix starting at block[pos]; returns (value, next pos)."""
    limit = (1 << prefix_bits) - 1
    value = block[pos] & limit
    pos += 1
    if value < limit:
        return value, pos
    shift = 0
    while True:
        if pos >= len(block) or shift > 28:
            raise ProtocolError(COMPRESSION_ERROR, "bad HPACK integer")
        byte = block[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


class Call:
    """One gRPC call (one HTTP/2 stream) as its listener sees it."""

    __slots__ = (
        "_conn",
        "_pending",
        "_queued_trailers",
        "_recv",
        "_recv_used",
        "_sent_headers",
        "closed",
        "finished",
        "half_closed",
        "listener",
        "method",
        "send_window",
        "stream_id",
    )

    def __init__(self, conn: _Connection, stream_id: int, method: str) -> None:
        self._conn = conn
        self.stream_id = stream_id
        self.method = method
        self.listener: Listener | None = None
        self.send_window = conn.peer_initial_window
        self._recv = bytearray()
        self._recv_used = 0
        self._pending: deque[bytes] = deque()
        self._queued_trailers: bytes | None = None
        self._sent_headers = False
        #: The client sent END_STREAM.
        self.half_closed = False
        #: We sent our trailers (or a reset).
        self.finished = False
        #: Gone from the connection: finished both ways, reset, or the connection was lost.
        self.closed = False

    def send(self, message: bytes) -> None:
        """Queue one response message; it goes out as the client's flow-control windows allow."""
        if self.finished:
            return
        conn = self._conn
        if not self._sent_headers:
            self._sent_headers = True
            conn.write(_frame(HEADERS, END_HEADERS, self.stream_id, _RESPONSE_HEADERS))
        data = b"\x00" + _FRAME_HEADER.pack(len(message)) + message
        size = len(data)
        if not self._pending and size <= self.send_window and size <= conn.send_window and size <= conn.peer_max_frame:
            self.send_window -= size
            conn.send_window -= size
            conn.write(_frame(DATA, 0, self.stream_id, data))
            return
        self._pending.append(data)
        self._flush()

    def finish(self, status: int = OK, message: str = "") -> None:
        """End the call with a gRPC status; response messages still queued go out first."""
        if self.finished:
            return
        self.finished = True
        block = _OK_TRAILERS if status == OK and not message else _trailers(status, message)
        if not self._sent_headers:
            # Trailers-only response: one HEADERS frame with the status.
            self._sent_headers = True
            self._queued_trailers = _RESPONSE_HEADERS + block
        else:
            self._queued_trailers = block
        self._flush()

    def _flush(self) -> None:
        conn = self._conn
        if self.closed:
            return
        while self._pending:
            data = self._pending[0]
            room = min(self.send_window, conn.send_window, conn.peer_max_frame)
            if room <= 0:
                conn.blocked.add(self)
                return
            chunk, rest = data[:room], data[room:]
            self.send_window -= len(chunk)
            conn.send_window -= len(chunk)
            conn.write(_frame(DATA, 0, self.stream_id, chunk))
            if rest:
                self._pending[0] = rest
            else:
                self._pending.popleft()
        conn.blocked.discard(self)
        if self._queued_trailers is not None:
            conn.write(_frame(HEADERS, END_HEADERS | END_STREAM, self.stream_id, self._queued_trailers))
            self._queued_trailers = None
            if self.half_closed:
                conn.forget(self)

    # -- from the connection -----------------------------------------------------------------

    def _data(self, payload: bytes, end_stream: bool, flow: int = 0) -> None:
        conn = self._conn
        if self.finished:
            if end_stream:
                self.half_closed = True
                if self._queued_trailers is None:
                    conn.forget(self)
            return
        buf = self._recv
        buf += payload
        self._recv_used += flow
        if self._recv_used >= _WINDOW_REFILL:  # a very long call: keep its window open
            conn.write(_frame(WINDOW_UPDATE, 0, self.stream_id, _FRAME_HEADER.pack(self._recv_used)))
            self._recv_used = 0
        while len(buf) >= 5:
            length = int.from_bytes(buf[1:5], "big")
            if buf[0] != 0:
                self._fail(UNIMPLEMENTED, "compressed messages are not supported")
                return
            if length > conn.server.max_message_bytes:
                self._fail(RESOURCE_EXHAUSTED, f"message of {length} bytes exceeds {conn.server.max_message_bytes}")
                return
            if len(buf) < 5 + length:
                break
            message = bytes(buf[5 : 5 + length])
            del buf[: 5 + length]
            self._deliver(message)
            if self.finished or self.closed:
                return
        if end_stream:
            self._end()

    def _end(self) -> None:
        self.half_closed = True
        if self._recv:
            self._fail(INTERNAL, "stream ended inside a message")
            return
        listener = self.listener
        if listener is not None:
            try:
                listener.on_half_close()
            except Exception:
                log.exception("listener failed on half-close (%s)", self.method)
                self._fail(INTERNAL, "internal error")
        if self.finished and self._queued_trailers is None:
            self._conn.forget(self)

    def _deliver(self, message: bytes) -> None:
        listener = self.listener
        if listener is None:
            return
        try:
            listener.on_message(message)
        except Exception:
            log.exception("listener failed on a message (%s)", self.method)
            self._fail(INTERNAL, "internal error")

    def _fail(self, status: int, message: str) -> None:
        """The call cannot go on: end it with a status and tell the listener it is over."""
        self._recv.clear()
        already = self.finished
        self.finish(status, message)
        if already:
            self.listener = None
        else:
            self._cancel_listener()

    def _cancel_listener(self) -> None:
        listener, self.listener = self.listener, None
        if listener is not None:
            try:
                listener.on_cancel()
            except Exception:
                log.exception("listener failed on cancel (%s)", self.method)

    def _reset(self) -> None:
        """The stream is gone (RST_STREAM, or the connection): no more sending.

        The listener hears `on_cancel` only if it had not finished the call itself.
        """
        was_finished = self.finished
        self.closed = True
        self.finished = True
        self._pending.clear()
        self._queued_trailers = None
        if was_finished:
            self.listener = None
        else:
            self._cancel_listener()


class _Connection(asyncio.Protocol):
    def __init__(self, server: H2GrpcServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._preface = False
        self._decoder = HeaderDecoder()
        self.calls: dict[int, Call] = {}
        self.blocked: set[Call] = set()
        self.last_stream_id = 0
        self.send_window = DEFAULT_WINDOW
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = DEFAULT_FRAME_SIZE
        self._recv_used = 0
        self._headers_block: tuple[int, int, bytearray] | None = None
        self._out: list[bytes] | None = None
        self._closing = False
        #: GOAWAY state: None (serving), "announced" (first GOAWAY sent), "final".
        self.goaway: str | None = None

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self.server.connections.add(self)
        settings = struct.pack(
            ">HIHIHIHI",
            SETTINGS_ENABLE_PUSH,
            0,
            SETTINGS_INITIAL_WINDOW_SIZE,
            MAX_WINDOW,
            SETTINGS_MAX_FRAME_SIZE,
            OUR_MAX_FRAME_SIZE,
            SETTINGS_MAX_HEADER_LIST_SIZE,
            MAX_HEADER_LIST_SIZE,
        )
        self.transport.write(
            _frame(SETTINGS, 0, 0, settings)
            + _frame(WINDOW_UPDATE, 0, 0, _FRAME_HEADER.pack(MAX_WINDOW - DEFAULT_WINDOW))
        )
        if self.server.draining:
            self.start_goaway()

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        out: list[bytes] = []
        self._out = out
        try:
            self._frames(data)
        except ProtocolError as exc:
            self._out = None
            self._abort(exc.code, str(exc), out)
            return
        except Exception:  # a bug here must not leave the connection half-parsed
            log.exception("HTTP/2 connection failed")
            self._out = None
            self._abort(INTERNAL_ERROR, "internal error", out)
            return
        self._out = None
        if out and self.transport is not None:
            self.transport.write(b"".join(out))

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self.server.connections.discard(self)
        calls = list(self.calls.values())
        self.calls.clear()
        self.blocked.clear()
        for call in calls:
            call._reset()
        self.server._calls_ended()

    # -- writing -----------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if self._out is not None:
            self._out.append(data)
        elif self.transport is not None and not self._closing:
            self.transport.write(data)

    def forget(self, call: Call) -> None:
        call.closed = True
        self.blocked.discard(call)
        self.calls.pop(call.stream_id, None)
        if not self.calls:
            self.server._calls_ended()
            if self.goaway == "final":
                self.close()

    def _drop(self, call: Call) -> None:
        """The call's stream was reset (by either side): forget it and stop it."""
        self.forget(call)
        call._reset()

    def close(self) -> None:
        if self.transport is not None and not self._closing:
            self._closing = True
            self.transport.close()

    def _abort(self, code: int, reason: str, out: list[bytes]) -> None:
        log.warning("closing HTTP/2 connection from %s: %s", self._peer(), reason)
        out.append(_frame(GOAWAY, 0, 0, struct.pack(">II", self.last_stream_id, code) + reason.encode()[:256]))
        if self.transport is not None:
            self.transport.write(b"".join(out))
        self.close()

    def _peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        return str(peer) if peer else "local socket"

    # -- draining ----------------------------------------------------------------------------

    def start_goaway(self) -> None:
        """First GOAWAY: no new streams please; a PING round trip later comes the final one."""
        if self.goaway is not None or self._closing:
            return
        self.goaway = "announced"
        self.write(_frame(GOAWAY, 0, 0, struct.pack(">II", MAX_WINDOW, NO_ERROR)))
        self.write(_frame(PING, 0, 0, _GOAWAY_PING))

    def _final_goaway(self) -> None:
        self.goaway = "final"
        self.write(_frame(GOAWAY, 0, 0, struct.pack(">II", self.last_stream_id, NO_ERROR)))
        if not self.calls:
            self.close()

    # -- reading -----------------------------------------------------------------------------

    def _frames(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos = 0
        if not self._preface:
            if len(buf) < len(PREFACE):
                if not PREFACE.startswith(bytes(buf)):
                    raise ProtocolError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                return
            if buf[: len(PREFACE)] != PREFACE:
                raise ProtocolError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            pos = len(PREFACE)
            self._preface = True
        end = len(buf)
        try:
            while end - pos >= 9:
                length = (buf[pos] << 16) | (buf[pos + 1] << 8) | buf[pos + 2]
                if length > OUR_MAX_FRAME_SIZE:
                    raise ProtocolError(FRAME_SIZE_ERROR, f"frame of {length} bytes exceeds {OUR_MAX_FRAME_SIZE}")
                if end - pos < 9 + length:
                    break
                kind = buf[pos + 3]
                flags = buf[pos + 4]
                stream_id = int.from_bytes(buf[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
                payload = bytes(buf[pos + 9 : pos + 9 + length])
                pos += 9 + length
                self._frame(kind, flags, stream_id, payload)
                if self._closing:
                    return
        finally:
            del buf[:pos]

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._headers_block is not None and kind != CONTINUATION:
            raise ProtocolError(PROTOCOL_ERROR, "expected CONTINUATION")
        if kind == DATA:
            self._on_data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._on_headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            block = self._headers_block
            if block is None or block[0] != stream_id:
                raise ProtocolError(PROTOCOL_ERROR, "unexpected CONTINUATION")
            block[2].extend(payload)
            if len(block[2]) > 4 * MAX_HEADER_LIST_SIZE:
                raise ProtocolError(PROTOCOL_ERROR, "header block too large")
            if flags & END_HEADERS:
                self._headers_block = None
                self._header_block_done(block[0], block[1], bytes(block[2]))
        elif kind == RST_STREAM:
            if stream_id == 0 or len(payload) != 4:
                raise ProtocolError(PROTOCOL_ERROR, "malformed RST_STREAM")
            call = self.calls.get(stream_id)
            if call is not None:
                self._drop(call)
        elif kind == SETTINGS:
            self._on_settings(flags, stream_id, payload)
        elif kind == PING:
            if stream_id != 0 or len(payload) != 8:
                raise ProtocolError(FRAME_SIZE_ERROR if len(payload) != 8 else PROTOCOL_ERROR, "malformed PING")
            if not flags & ACK:
                self.write(_frame(PING, ACK, 0, payload))
            elif payload == _GOAWAY_PING and self.goaway == "announced":
                self._final_goaway()
        elif kind == WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
        elif kind == GOAWAY:
            if stream_id != 0 or len(payload) < 8:
                raise ProtocolError(PROTOCOL_ERROR, "malformed GOAWAY")
            # The client will open no new streams; the ones it has still get their answers.
        elif kind == PUSH_PROMISE:
            raise ProtocolError(PROTOCOL_ERROR, "clients may not push")
        elif kind == PRIORITY and (stream_id == 0 or len(payload) != 5):
            raise ProtocolError(PROTOCOL_ERROR, "malformed PRIORITY")
        # Unknown frame types are ignored (RFC 9113 §4.1).

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ProtocolError(PROTOCOL_ERROR, "DATA on stream 0")
        flow = len(payload)  # padding counts against flow control too
        self._recv_used += flow
        if self._recv_used >= _WINDOW_REFILL:
            self.write(_frame(WINDOW_UPDATE, 0, 0, _FRAME_HEADER.pack(self._recv_used)))
            self._recv_used = 0
        if flags & PADDED:
            payload = _unpad(payload)
        call = self.calls.get(stream_id)
        if call is None:
            if stream_id > self.last_stream_id:
                raise ProtocolError(PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
            return  # a stream we already closed or reset: late frames are dropped
        if call.half_closed:
            self.write(_frame(RST_STREAM, 0, stream_id, struct.pack(">I", STREAM_CLOSED)))
            self._drop(call)
            return
        call._data(payload, bool(flags & END_STREAM), flow)

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ProtocolError(PROTOCOL_ERROR, "HEADERS on stream 0")
        if flags & PADDED:
            payload = _unpad(payload)
        if flags & PRIORITY_FLAG:
            if len(payload) < 5:
                raise ProtocolError(PROTOCOL_ERROR, "short HEADERS priority block")
            payload = payload[5:]
        if flags & END_HEADERS:
            self._header_block_done(stream_id, flags, payload)
        else:
            self._headers_block = (stream_id, flags, bytearray(payload))

    def _header_block_done(self, stream_id: int, flags: int, block: bytes) -> None:
        headers = self._decoder.decode(block)
        call = self.calls.get(stream_id)
        if call is not None:  # trailers from the client: only allowed to end the stream
            if not flags & END_STREAM:
                raise ProtocolError(PROTOCOL_ERROR, "HEADERS in the middle of a stream")
            if call.half_closed:
                raise ProtocolError(STREAM_CLOSED, "HEADERS after END_STREAM")
            call._data(b"", True)
            return
        if stream_id % 2 == 0:
            raise ProtocolError(PROTOCOL_ERROR, f"clients open odd streams, not {stream_id}")
        if stream_id <= self.last_stream_id:
            return  # late trailers for a stream we already closed or reset
        self.last_stream_id = stream_id
        if self.goaway == "final":
            self.write(_frame(RST_STREAM, 0, stream_id, struct.pack(">I", REFUSED_STREAM)))
            return
        method = path = content_type = b""
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b":method":
                method = value
            elif name == b"content-type":
                content_type = value
        call = Call(self, stream_id, path.decode("ascii", "replace"))
        self.calls[stream_id] = call
        factory = self.server.methods.get(call.method)
        if method != b"POST" or not content_type.startswith(b"application/grpc"):
            call.finish(UNIMPLEMENTED, "expected a gRPC request (POST, content-type application/grpc)")
        elif factory is None:
            call.finish(UNIMPLEMENTED, f"unknown method {call.method}")
        else:
            try:
                call.listener = factory(call)
            except Exception:
                log.exception("could not start a call to %s", call.method)
                call.finish(INTERNAL, "internal error")
        if flags & END_STREAM:
            call._end()

    def _on_settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id != 0:
            raise ProtocolError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ProtocolError(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise ProtocolError(FRAME_SIZE_ERROR, "SETTINGS length not a multiple of 6")
        for offset in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, offset)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ProtocolError(FLOW_CONTROL_ERROR, "initial window size too large")
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for call in self.calls.values():
                    call.send_window += delta
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not DEFAULT_FRAME_SIZE <= value <= 2**24 - 1:
                    raise ProtocolError(PROTOCOL_ERROR, "max frame size out of range")
                self.peer_max_frame = value
            elif key == SETTINGS_ENABLE_PUSH and value > 1:
                raise ProtocolError(PROTOCOL_ERROR, "ENABLE_PUSH must be 0 or 1")
            # HEADER_TABLE_SIZE: what we send never uses the dynamic table; the rest are limits
            # on what we may send that a unary/bidi gRPC response never comes near.
        self.write(_frame(SETTINGS, ACK, 0))
        self._unblock()

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ProtocolError(FRAME_SIZE_ERROR, "malformed WINDOW_UPDATE")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if stream_id == 0:
            if increment == 0:
                raise ProtocolError(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise ProtocolError(FLOW_CONTROL_ERROR, "connection window overflow")
            self._unblock()
            return
        call = self.calls.get(stream_id)
        if call is None:
            return
        if increment == 0 or call.send_window + increment > MAX_WINDOW:
            self.write(_frame(RST_STREAM, 0, stream_id, struct.pack(">I", FLOW_CONTROL_ERROR)))
            self._drop(call)
            return
        call.send_window += increment
        if call in self.blocked:
            call._flush()

    def _unblock(self) -> None:
        for call in list(self.blocked):
            if self.send_window <= 0:
                return
            call._flush()


def _unpad(payload: bytes) -> bytes:
    if not payload:
        raise ProtocolError(PROTOCOL_ERROR, "padded frame without a pad length")
    pad = payload[0]
    if pad >= len(payload):
        raise ProtocolError(PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1 : len(payload) - pad]


def host_port(address: str) -> tuple[str, int]:
    """HOST:PORT (HOST may be [v6] or empty for 127.0.0.1), as extproc's listeners take it."""
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


class H2GrpcServer:
    """Serves gRPC methods (full names, '/package.Service/Method') on TCP or a Unix socket."""

    def __init__(self, methods: dict[str, Method], *, max_message_bytes: int = 4 * 1024 * 1024) -> None:
        self.methods = dict(methods)
        self.max_message_bytes = max_message_bytes
        self.connections: set[_Connection] = set()
        self.draining = False
        self._servers: list[asyncio.Server] = []
        self._idle = asyncio.Event()

    async def listen(self, address: str) -> str:
        """Listen on HOST:PORT or unix:PATH; returns the address actually bound."""
        loop = asyncio.get_running_loop()
        if address.startswith("unix:"):
            path = address[len("unix:") :]
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            server = await loop.create_unix_server(lambda: _Connection(self), path)
            self._servers.append(server)
            return address
        host, port = host_port(address)
        server = await loop.create_server(lambda: _Connection(self), host, port)
        self._servers.append(server)
        bound = server.sockets[0].getsockname()[1]
        return f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"

    @property
    def active_calls(self) -> int:
        return sum(len(conn.calls) for conn in self.connections)

    async def stop(self, grace: float) -> None:
        """Refuse new calls, let the open ones finish for up to `grace` seconds, then cut them."""
        self.draining = True
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            conn.start_goaway()
            if not conn.calls and conn.goaway == "final":
                conn.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.active_calls and loop.time() < deadline:
            self._idle.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), max(0.0, deadline - loop.time()))
        for conn in list(self.connections):
            if conn.calls:
                log.warning("cutting %d call(s) still open after %.0fs", len(conn.calls), grace)
            conn.close()
        for server in self._servers:
            await server.wait_closed()

    def _calls_ended(self) -> None:
        """A connection has no calls left (or is gone): wake a stop() that waits for that."""
        if self.draining:
            self._idle.set()


class GrpcError(Exception):
    """Raised by a unary handler to end its call with a gRPC status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _UnaryCall:
    __slots__ = ("_call", "_handler", "_request")

    def __init__(self, call: Call, handler: Callable[[bytes], bytes]) -> None:
        self._call = call
        self._handler = handler
        self._request: bytes | None = None

    def on_message(self, data: bytes) -> None:
        if self._request is not None:
            self._call.finish(INVALID_ARGUMENT, "a unary call takes one message")
            return
        self._request = data

    def on_half_close(self) -> None:
        if self._request is None:
            self._call.finish(INVALID_ARGUMENT, "a unary call takes one message")
            return
        try:
            response = self._handler(self._request)
        except GrpcError as exc:
            self._call.finish(exc.status, exc.message)
            return
        self._call.send(response)
        self._call.finish()

    def on_cancel(self) -> None:
        self._request = None


def unary(handler: Callable[[bytes], bytes]) -> Method:
    """A method answering one request message with one response message, on the loop thread."""
    return lambda call: _UnaryCall(call, handler)
