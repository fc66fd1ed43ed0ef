"""The HTTP/2 side of the server (RFC 9113): connections, streams, flow control, draining.

It knows nothing of gRPC. For each new stream the server's `new_stream` callback builds the
`Stream` object from the decoded request headers: an application protocol subclasses
`Stream` (gRPC's `Call` does) and overrides its hooks, `on_data` for each DATA payload,
`on_end` when the client has sent everything, and `on_reset` once if the stream is reset or
the connection is lost before it ended. It answers with `write_headers()`, `write_data()`,
then `end()` with the last header block. One object per stream, on the event loop thread,
without a task.

What it speaks: cleartext HTTP/2 with prior knowledge (no TLS, no server push, no
priorities):

* frames: DATA, HEADERS + CONTINUATION, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE;
  PRIORITY and unknown frame types are ignored, PUSH_PROMISE is a protocol error;
* flow control both ways: we open our receive windows wide once and top the connection
  window up as it drains; what we send waits for the client's windows;
* draining: two GOAWAYs (the first announces, a PING round trip later the second names the
  last stream we will serve), so streams already on the wire are not refused.

A protocol error from the client ends its connection with GOAWAY and the error code; it
never affects other connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
from collections import deque
from collections.abc import Callable
from typing import cast

from wakegate.extproc.h2grpc.hpack import MAX_HEADER_LIST_SIZE, HeaderDecoder, HpackError

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

MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65_535
DEFAULT_FRAME_SIZE = 16_384
#: Largest frame we accept; large bodies then arrive in few frames.
OUR_MAX_FRAME_SIZE = 1 << 20
#: Top a receive window up once this much of it has been used.
_WINDOW_REFILL = 1 << 30
_GOAWAY_PING = b"wg-drain"
_FRAME_HEADER = struct.Struct(">I")


class ProtocolError(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return _FRAME_HEADER.pack(len(payload))[1:] + bytes((kind, flags)) + _FRAME_HEADER.pack(stream_id) + payload


class Stream:
    """One HTTP/2 stream of a connection; subclasses give it an application protocol."""

    __slots__ = (
        "_conn",
        "_pending",
        "_queued_end",
        "_recv_used",
        "closed",
        "ended",
        "half_closed",
        "send_window",
        "stream_id",
    )

    def __init__(self, conn: Connection, stream_id: int) -> None:
        self._conn = conn
        self.stream_id = stream_id
        self.send_window = conn.peer_initial_window
        self._recv_used = 0
        self._pending: deque[bytes] = deque()
        self._queued_end: bytes | None = None
        #: The client sent END_STREAM.
        self.half_closed = False
        #: We ended our side (the last header block is queued or sent), or the stream was reset.
        self.ended = False
        #: Gone from the connection: ended both ways, reset, or the connection was lost.
        self.closed = False

    # -- hooks for the application protocol ---------------------------------------------------

    def on_data(self, data: bytes) -> None:
        """A DATA payload arrived (never after `end()`)."""

    def on_end(self) -> None:
        """The client sent END_STREAM (not heard after `end()`)."""

    def on_reset(self) -> None:
        """The stream was reset, or the connection lost, before `end()`."""

    # -- answering -----------------------------------------------------------------------------

    def write_headers(self, block: bytes) -> None:
        """Send a header block (response headers) at once; it does not end the stream."""
        if not self.ended:
            self._conn.write(frame(HEADERS, END_HEADERS, self.stream_id, block))

    def write_data(self, data: bytes) -> None:
        """Queue data; it goes out as the client's flow-control windows allow."""
        if self.ended:
            return
        conn = self._conn
        size = len(data)
        if not self._pending and size <= self.send_window and size <= conn.send_window and size <= conn.peer_max_frame:
            self.send_window -= size
            conn.send_window -= size
            conn.write(frame(DATA, 0, self.stream_id, data))
            return
        self._pending.append(data)
        self._flush()

    def end(self, block: bytes) -> None:
        """End our side with a last header block (trailers), after the data still queued."""
        if self.ended:
            return
        self.ended = True
        self._queued_end = block
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
            conn.write(frame(DATA, 0, self.stream_id, chunk))
            if rest:
                self._pending[0] = rest
            else:
                self._pending.popleft()
        conn.blocked.discard(self)
        if self._queued_end is not None:
            conn.write(frame(HEADERS, END_HEADERS | END_STREAM, self.stream_id, self._queued_end))
            self._queued_end = None
            if self.half_closed:
                conn.forget(self)

    # -- from the connection -----------------------------------------------------------------

    def _received(self, payload: bytes, end_stream: bool, flow: int = 0) -> None:
        if not self.ended:
            self._recv_used += flow
            if self._recv_used >= _WINDOW_REFILL:  # a very long stream: keep its window open
                self._conn.write(frame(WINDOW_UPDATE, 0, self.stream_id, _FRAME_HEADER.pack(self._recv_used)))
                self._recv_used = 0
            if payload:
                self.on_data(payload)
        if end_stream:
            self._remote_end()

    def _remote_end(self) -> None:
        self.half_closed = True
        if not self.ended:
            self.on_end()
        if self.ended and self._queued_end is None and not self.closed:
            self._conn.forget(self)

    def _reset(self) -> None:
        """The stream is gone (RST_STREAM, or the connection): no more sending.

        `on_reset` runs only if we had not ended the stream ourselves.
        """
        was_ended = self.ended
        self.closed = True
        self.ended = True
        self._pending.clear()
        self._queued_end = None
        if not was_ended:
            try:
                self.on_reset()
            except Exception:
                log.exception("stream failed on reset")


class Connection(asyncio.Protocol):
    def __init__(self, server: H2Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._preface = False
        self._decoder = HeaderDecoder(MAX_HEADER_LIST_SIZE)
        self.streams: dict[int, Stream] = {}
        self.blocked: set[Stream] = set()
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
        window = frame(WINDOW_UPDATE, 0, 0, _FRAME_HEADER.pack(MAX_WINDOW - DEFAULT_WINDOW))
        self.transport.write(frame(SETTINGS, 0, 0, settings) + window)
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
        streams = list(self.streams.values())
        self.streams.clear()
        self.blocked.clear()
        for stream in streams:
            stream._reset()
        self.server._streams_ended()

    # -- writing -----------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if self._out is not None:
            self._out.append(data)
        elif self.transport is not None and not self._closing:
            self.transport.write(data)

    def forget(self, stream: Stream) -> None:
        stream.closed = True
        self.blocked.discard(stream)
        self.streams.pop(stream.stream_id, None)
        if not self.streams:
            self.server._streams_ended()
            if self.goaway == "final":
                self.close()

    def _drop(self, stream: Stream) -> None:
        """The stream was reset (by either side): forget it and stop it."""
        self.forget(stream)
        stream._reset()

    def _refuse(self, stream_id: int, code: int) -> None:
        self.write(frame(RST_STREAM, 0, stream_id, struct.pack(">I", code)))

    def close(self) -> None:
        if self.transport is not None and not self._closing:
            self._closing = True
            self.transport.close()

    def _abort(self, code: int, reason: str, out: list[bytes]) -> None:
        log.warning("closing HTTP/2 connection from %s: %s", self._peer(), reason)
        out.append(frame(GOAWAY, 0, 0, struct.pack(">II", self.last_stream_id, code) + reason.encode()[:256]))
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
        self.write(frame(GOAWAY, 0, 0, struct.pack(">II", MAX_WINDOW, NO_ERROR)))
        self.write(frame(PING, 0, 0, _GOAWAY_PING))

    def _final_goaway(self) -> None:
        self.goaway = "final"
        self.write(frame(GOAWAY, 0, 0, struct.pack(">II", self.last_stream_id, NO_ERROR)))
        if not self.streams:
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
            stream = self.streams.get(stream_id)
            if stream is not None:
                self._drop(stream)
        elif kind == SETTINGS:
            self._on_settings(flags, stream_id, payload)
        elif kind == PING:
            if stream_id != 0 or len(payload) != 8:
                raise ProtocolError(FRAME_SIZE_ERROR if len(payload) != 8 else PROTOCOL_ERROR, "malformed PING")
            if not flags & ACK:
                self.write(frame(PING, ACK, 0, payload))
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
            self.write(frame(WINDOW_UPDATE, 0, 0, _FRAME_HEADER.pack(self._recv_used)))
            self._recv_used = 0
        if flags & PADDED:
            payload = _unpad(payload)
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id > self.last_stream_id:
                raise ProtocolError(PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
            return  # a stream we already closed or reset: late frames are dropped
        if stream.half_closed:
            self._refuse(stream_id, STREAM_CLOSED)
            self._drop(stream)
            return
        stream._received(payload, bool(flags & END_STREAM), flow)

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
        try:
            headers = self._decoder.decode(block)
        except HpackError as exc:
            raise ProtocolError(PROTOCOL_ERROR if exc.too_large else COMPRESSION_ERROR, str(exc)) from None
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers from the client: only allowed to end the stream
            if not flags & END_STREAM:
                raise ProtocolError(PROTOCOL_ERROR, "HEADERS in the middle of a stream")
            if stream.half_closed:
                raise ProtocolError(STREAM_CLOSED, "HEADERS after END_STREAM")
            stream._received(b"", True)
            return
        if stream_id % 2 == 0:
            raise ProtocolError(PROTOCOL_ERROR, f"clients open odd streams, not {stream_id}")
        if stream_id <= self.last_stream_id:
            return  # late trailers for a stream we already closed or reset
        self.last_stream_id = stream_id
        if self.goaway == "final":
            self._refuse(stream_id, REFUSED_STREAM)
            return
        try:
            stream = self.server.new_stream(self, stream_id, headers)
        except Exception:
            log.exception("could not start stream %d", stream_id)
            self._refuse(stream_id, INTERNAL_ERROR)
            return
        self.streams[stream_id] = stream
        if flags & END_STREAM:
            stream._received(b"", True)

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
                for stream in self.streams.values():
                    stream.send_window += delta
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not DEFAULT_FRAME_SIZE <= value <= 2**24 - 1:
                    raise ProtocolError(PROTOCOL_ERROR, "max frame size out of range")
                self.peer_max_frame = value
            elif key == SETTINGS_ENABLE_PUSH and value > 1:
                raise ProtocolError(PROTOCOL_ERROR, "ENABLE_PUSH must be 0 or 1")
            # HEADER_TABLE_SIZE: what we send never uses the dynamic table; the rest are limits
            # on what we may send that a unary/bidi gRPC response never comes near.
        self.write(frame(SETTINGS, ACK, 0))
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
        stream = self.streams.get(stream_id)
        if stream is None:
            return
        if increment == 0 or stream.send_window + increment > MAX_WINDOW:
            self._refuse(stream_id, FLOW_CONTROL_ERROR)
            self._drop(stream)
            return
        stream.send_window += increment
        if stream in self.blocked:
            stream._flush()

    def _unblock(self) -> None:
        for stream in list(self.blocked):
            if self.send_window <= 0:
                return
            stream._flush()


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


#: Builds the stream object of a new stream from its connection, id and request headers.
NewStream = Callable[[Connection, int, list[tuple[bytes, bytes]]], Stream]


class H2Server:
    """Accepts HTTP/2 connections on TCP or a Unix socket; `new_stream` builds each stream."""

    def __init__(self, new_stream: NewStream) -> None:
        self.new_stream = new_stream
        self.connections: set[Connection] = set()
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
            server = await loop.create_unix_server(lambda: Connection(self), path)
            self._servers.append(server)
            return address
        host, port = host_port(address)
        server = await loop.create_server(lambda: Connection(self), host, port)
        self._servers.append(server)
        bound = server.sockets[0].getsockname()[1]
        return f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"

    @property
    def active_streams(self) -> int:
        return sum(len(conn.streams) for conn in self.connections)

    async def stop(self, grace: float) -> None:
        """Refuse new streams, let the open ones finish for up to `grace` seconds, then cut them."""
        self.draining = True
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            conn.start_goaway()
            if not conn.streams and conn.goaway == "final":
                conn.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.active_streams and loop.time() < deadline:
            self._idle.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), max(0.0, deadline - loop.time()))
        for conn in list(self.connections):
            if conn.streams:
                log.warning("cutting %d stream(s) still open after %.0fs", len(conn.streams), grace)
            conn.close()
        for server in self._servers:
            await server.wait_closed()

    def _streams_ended(self) -> None:
        """A connection has no streams left (or is gone): wake a stop() that waits for that."""
        if self.draining:
            self._idle.set()
