"""The HTTP/2 side of the server (RFC 9113): connections, streams, flow control, draining, limits.

It knows nothing of gRPC. For each new stream the server's `new_stream` callback builds the
`Stream` object from the decoded request headers: an application protocol subclasses
`Stream` (gRPC's `Call` does) and overrides its hooks, `on_data` for each DATA payload,
`on_end` when the client has sent everything, and `on_reset` once if the stream is reset or
the connection is lost before it ended. It answers with `write_headers()`, `write_data()`,
then `end()` with the last header block (or none). One object per stream, on the event loop
thread, without a task.

What it speaks: cleartext HTTP/2 with prior knowledge (no TLS, no server push, no
priorities):

* frames: DATA, HEADERS + CONTINUATION, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE;
  PRIORITY (checked, then ignored) and unknown frame types are ignored, PUSH_PROMISE is a
  protocol error;
* requests are checked as RFC 9113 §8 asks (pseudo-headers, lowercase names, no
  connection-specific fields, content-length against the DATA received): a malformed one is
  reset with PROTOCOL_ERROR;
* flow control both ways: stream receive windows are opened wide (the application bounds
  what one stream may buffer), the connection's receive window is `connection_window` and
  is given back as the application consumes what it buffered; what we send waits for the
  client's windows;
* draining: two GOAWAYs (the first announces, a PING round trip later the second names the
  last stream we will serve), so streams already on the wire are not refused.

A protocol error from the client ends its connection with GOAWAY and the error code; it
never affects other connections. What one connection may cost is bounded by `H2Limits`
(limits.py): concurrent streams, frame budgets (PING, SETTINGS, RST_STREAM, WINDOW_UPDATE,
PRIORITY, empty frames, rapid resets), HPACK work, buffered input and unsent output, idle
and preface timeouts, and frames handled per turn of the event loop. Overrunning a budget
ends the connection with GOAWAY ENHANCE_YOUR_CALM; the server counts each such refusal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import cast

from wakegate.extproc.h2grpc.hpack import HeaderDecoder, HpackError
from wakegate.extproc.h2grpc.limits import Budget, H2Limits

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
ENHANCE_YOUR_CALM = 0xB

MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65_535
DEFAULT_FRAME_SIZE = 16_384
#: Top a stream's receive window up once this much of it has been used.
_WINDOW_REFILL = 1 << 30
_GOAWAY_PING = b"wg-drain"
_IDLE_PING = b"wg-alive"
_FRAME_HEADER = struct.Struct(">I")
#: `Stream.end(None)`: the stream ends with an empty DATA frame, not trailers.
_NO_TRAILERS = b""
#: Stream ids we reset ourselves, remembered so that the client's late frames on them are
#: ignored (RFC 9113 §5.1, "closed") rather than answered as errors.
_RESET_MEMORY = 1024
#: Accept queue: a burst of connections (an attack, or many at once) must not make Envoy's own
#: connect wait for a SYN retry (its connect timeout to extproc is 1 s). The kernel caps it at
#: net.core.somaxconn.
_BACKLOG = 4096
#: Seconds a connection we ended keeps being read (and dropped) before it is closed, and
#: bytes at most (a client that keeps sending gets no more of our reading).
_LINGER = 0.2
_LINGER_BYTES = 256 * 1024
#: Unhandled input (frames left for the next turn) above which we stop reading the connection.
_READ_AHEAD = 256 * 1024

#: The request pseudo-headers, each a bit (:path is 4: it must not be empty; the first three must be there).
_PSEUDO_BITS = {b":method": 1, b":scheme": 2, b":path": 4, b":authority": 8}
#: Regular fields a request is checked for: 0 connection-specific (never allowed), 1 te, 2 content-length.
_SPECIAL_HEADERS = {
    b"connection": 0, b"keep-alive": 0, b"proxy-connection": 0, b"transfer-encoding": 0, b"upgrade": 0,
    b"te": 1, b"content-length": 2,
}  # fmt: skip


class ProtocolError(Exception):
    def __init__(self, code: int, reason: str, refusal: str = "") -> None:
        super().__init__(reason)
        self.code = code
        #: For ENHANCE_YOUR_CALM: which limit it was (the server counts refusals by it).
        self.refusal = refusal


def calm(refusal: str, reason: str) -> ProtocolError:
    return ProtocolError(ENHANCE_YOUR_CALM, reason, refusal)


class _StreamError(Exception):
    """A malformed request: the stream is reset with `code`, the connection goes on."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


def frame(kind: int, flags: int, stream_id: int, payload: bytes | memoryview = b"") -> bytes:
    return _FRAME_HEADER.pack(len(payload))[1:] + bytes((kind, flags)) + _FRAME_HEADER.pack(stream_id) + payload


class Stream:
    """One HTTP/2 stream of a connection; subclasses give it an application protocol."""

    __slots__ = (
        "_conn",
        "_expected_length",
        "_held",
        "_opened",
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
        # Queued data as views: a frame's chunk is a slice of the view, so sending a message in
        # N frames copies each byte once (slicing bytes would copy the rest of it every frame).
        self._pending: deque[memoryview] = deque()
        self._queued_end: bytes | None = None
        #: Bytes of received DATA the application still holds (see `buffered()`).
        self._held = 0
        #: content-length the client announced, counted down by the DATA it sends; or None.
        self._expected_length: int | None = None
        self._opened = 0.0
        #: The client sent END_STREAM.
        self.half_closed = False
        #: We ended our side (the last frame is queued or sent), or the stream was reset.
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

    def buffered(self) -> int:
        """Bytes of received DATA the application keeps for later (a partial message).

        The connection's receive window is given back only as these are released, so what
        all streams of a connection buffer stays within `connection_window`."""
        return 0

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
            conn.data_frames_sent += 1
            conn.write(frame(DATA, 0, self.stream_id, data))
            return
        self._pending.append(memoryview(data))
        self._flush()

    def end(self, block: bytes | None) -> None:
        """End our side after the data still queued: with a last header block (trailers), or
        with an empty END_STREAM DATA frame when `block` is None."""
        if self.ended:
            return
        self.ended = True
        self._queued_end = block if block is not None else _NO_TRAILERS
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
            conn.data_frames_sent += 1
            conn.write(frame(DATA, 0, self.stream_id, chunk))
            if rest:
                self._pending[0] = rest
            else:
                self._pending.popleft()
        conn.blocked.discard(self)
        last = self._queued_end
        if last is not None:
            if last is _NO_TRAILERS:  # an empty DATA frame ends the stream
                conn.write(frame(DATA, END_STREAM, self.stream_id))
            else:
                conn.write(frame(HEADERS, END_HEADERS | END_STREAM, self.stream_id, last))
            self._queued_end = None
            if self.half_closed:
                conn.forget(self)

    # -- from the connection -----------------------------------------------------------------

    def _received(self, payload: bytes, end_stream: bool, flow: int = 0) -> None:
        conn = self._conn
        if self._expected_length is not None:
            self._expected_length -= len(payload)
            if self._expected_length < 0 or (end_stream and self._expected_length):
                conn.release(flow)
                raise _StreamError(PROTOCOL_ERROR, "DATA does not match content-length")
        if not self.ended:
            self._recv_used += flow
            if self._recv_used >= _WINDOW_REFILL:  # a very long stream: keep its window open
                conn.write(frame(WINDOW_UPDATE, 0, self.stream_id, _FRAME_HEADER.pack(self._recv_used)))
                self._recv_used = 0
            if payload:
                held = self._held
                self.on_data(payload)
                self._held = self.buffered() if not self.ended else 0
                flow += held - self._held
        if flow:
            owed = conn._owed + flow
            if owed < conn._owed_limit:  # the usual case, without a call
                conn._owed = owed
            else:
                conn.release(flow)
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
        limits = self.limits = server.limits
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._preface = False
        self._decoder = HeaderDecoder(
            limits.max_header_list_size, huffman_per_block=limits.huffman_per_block, huffman_budget=limits.huffman_burst
        )
        self.streams: dict[int, Stream] = {}
        self.blocked: set[Stream] = set()
        self.last_stream_id = 0
        self.send_window = DEFAULT_WINDOW
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = DEFAULT_FRAME_SIZE
        #: Our connection receive window as the client sees it, and what we owe it back.
        self._recv_window = limits.connection_window
        self._owed = 0
        #: `_owed` below this needs no WINDOW_UPDATE yet (0 while more than half the window is used)
        self._owed_limit = limits.connection_window >> 2
        self._half_window = limits.connection_window >> 1
        self._headers_block: tuple[int, int, bytearray] | None = None
        self._out: list[bytes] | None = None
        self._closing = False
        #: GOAWAY state: None (serving), "announced" (first GOAWAY sent), "final".
        self.goaway: str | None = None
        #: Reading pauses while our output is not drained, or too much input waits for later turns.
        self._backlog = False
        self._write_paused = False
        self._reading_paused = False
        self._heard = True
        self._alive_ping = False
        self._timer: asyncio.TimerHandle | None = None
        self._reset_ids: dict[int, None] = {}
        self._lingered = 0
        self.data_frames_sent = 0
        self._data_frames_seen = 0
        self._empty_frames = 0
        self._streams_done = 0
        self._premature_resets = 0
        self._pings = Budget(limits.ping_burst, limits.ping_per_second)
        self._settings = Budget(limits.settings_burst, limits.settings_per_second)
        self._rsts = Budget(limits.rst_burst, limits.rst_per_second)
        self._window_updates = Budget(limits.window_update_burst, limits.window_update_per_second)
        self._priorities = Budget(limits.priority_burst, limits.priority_per_second)

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        server = self.server
        limits = self.limits
        if len(server.connections) >= limits.max_connections:
            server.refuse("connection_limit")
            self._closing = True
            self.transport.abort()
            return
        server.connections.add(self)
        self.transport.set_write_buffer_limits(high=limits.write_buffer)
        settings = struct.pack(
            ">HIHIHIHIHI",
            SETTINGS_ENABLE_PUSH,
            0,
            SETTINGS_MAX_CONCURRENT_STREAMS,
            limits.max_concurrent_streams,
            SETTINGS_INITIAL_WINDOW_SIZE,
            MAX_WINDOW,
            SETTINGS_MAX_FRAME_SIZE,
            limits.max_frame_size,
            SETTINGS_MAX_HEADER_LIST_SIZE,
            limits.max_header_list_size,
        )
        out = frame(SETTINGS, 0, 0, settings)
        if limits.connection_window > DEFAULT_WINDOW:
            out += frame(WINDOW_UPDATE, 0, 0, _FRAME_HEADER.pack(limits.connection_window - DEFAULT_WINDOW))
        self.transport.write(out)
        self._timer = asyncio.get_running_loop().call_later(limits.preface_timeout, self._preface_timeout)
        if server.draining:
            self.start_goaway()

    def data_received(self, data: bytes) -> None:
        if self._closing:
            self._lingered += len(data)
            if self._lingered > _LINGER_BYTES and self.transport is not None:
                self.transport.close()  # it is not stopping: no more reading for it
            return
        self._buf += data
        self._heard = True
        if not self._backlog:
            self._turn()
        elif len(self._buf) > _READ_AHEAD:
            self._update_reading()

    def _turn(self) -> None:
        """Handle up to `frames_per_turn` frames; if more are waiting, come back on the next turn."""
        out: list[bytes] = []
        self._out = out
        more = False
        try:
            more = self._frames()
        except ProtocolError as exc:
            self._out = None
            self.server.refuse(exc.refusal or "protocol_error")
            self._abort(exc.code, str(exc), out)
            return
        except Exception:  # a bug here must not leave the connection half-parsed
            log.exception("HTTP/2 connection failed")
            self._out = None
            self._abort(INTERNAL_ERROR, "internal error", out)
            return
        self._out = None
        if out and self.transport is not None and not self._closing:
            self.transport.write(b"".join(out))
        if self._closing:
            return
        if more:
            self._backlog = True
            asyncio.get_running_loop().call_soon(self._next_turn)
        self._update_reading()

    def _next_turn(self) -> None:
        self._backlog = False
        if not self._closing:
            self._turn()

    def pause_writing(self) -> None:
        self._write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._update_reading()

    def _update_reading(self) -> None:
        """Read only while the client takes what we write, and we are not far behind its frames."""
        transport = self.transport
        if transport is None or self._closing:
            return
        pause = self._write_paused or (self._backlog and len(self._buf) > _READ_AHEAD)
        if pause != self._reading_paused:
            self._reading_paused = pause
            if pause:
                transport.pause_reading()
            else:
                transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.server.connections.discard(self)
        streams = list(self.streams.values())
        self.streams.clear()
        self.blocked.clear()
        for stream in streams:
            stream._reset()
        self.server._streams_ended()

    # -- timers --------------------------------------------------------------------------------

    def _preface_timeout(self) -> None:
        if self._closing:
            return
        if not self._preface:
            self.server.refuse("preface_timeout")
            self._abort(PROTOCOL_ERROR, "no connection preface in time", [])
            return
        self._heard = False
        self._timer = asyncio.get_running_loop().call_later(self.limits.idle_timeout, self._idle_check)

    def _idle_check(self) -> None:
        """Every `idle_timeout`: close a connection we did not hear from since the last check."""
        if self._closing:
            return
        if not self._heard:
            if self._alive_ping or (self.goaway is not None and not self.streams):
                # It did not answer our PING (or our GOAWAY's) within a whole period: gone.
                self.server.refuse("idle_timeout")
                self.close()
                return
            if self.streams:  # waiting on its streams: ask it to prove it is still there
                self._alive_ping = True
                self.write(frame(PING, 0, 0, _IDLE_PING))
            else:  # nothing open, nothing said: let it go the graceful way
                self.start_goaway()
        self._heard = False
        self._timer = asyncio.get_running_loop().call_later(self.limits.idle_timeout, self._idle_check)

    # -- writing -----------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if self._out is not None:
            self._out.append(data)
        elif self.transport is not None and not self._closing:
            self.transport.write(data)

    def release(self, size: int) -> None:
        """The application let go of `size` received bytes: give them back to the client's window
        (in one WINDOW_UPDATE per quarter window, or at once while more than half of it is used)."""
        owed = self._owed + size
        if owed >= self._half_window >> 1 or self._recv_window < self._half_window:
            self._recv_window += owed
            self._owed = 0
            self.write(frame(WINDOW_UPDATE, 0, 0, _FRAME_HEADER.pack(owed)))
        else:
            self._owed = owed
        self._owed_limit = 0 if self._recv_window < self._half_window else self._half_window >> 1

    def forget(self, stream: Stream) -> None:
        stream.closed = True
        self.blocked.discard(stream)
        if self.streams.pop(stream.stream_id, None) is not None:
            self._streams_done += 1
            if stream._held:
                held, stream._held = stream._held, 0
                self.release(held)
        if not self.streams:
            self.server._streams_ended()
            if self.goaway == "final":
                self.close()

    def _drop(self, stream: Stream) -> None:
        """The stream was reset (by either side): forget it and stop it."""
        self.forget(stream)
        stream._reset()

    def _refuse(self, stream_id: int, code: int) -> None:
        """Reset a stream ourselves; the client's frames still on the wire for it are ignored."""
        self.write(frame(RST_STREAM, 0, stream_id, struct.pack(">I", code)))
        reset = self._reset_ids
        reset[stream_id] = None
        if len(reset) > _RESET_MEMORY:
            del reset[next(iter(reset))]

    def _stream_error(self, stream_id: int, code: int) -> None:
        stream = self.streams.get(stream_id)
        self._refuse(stream_id, code)
        if stream is not None:
            self._drop(stream)

    def close(self) -> None:
        if self.transport is not None and not self._closing:
            if self._out:  # what this turn wrote (a final GOAWAY) goes out before the close
                self.transport.write(b"".join(self._out))
                self._out.clear()
            self._closing = True
            self.transport.close()

    def _abort(self, code: int, reason: str, out: list[bytes]) -> None:
        if self.server.log_budget.take():
            log.warning("closing HTTP/2 connection from %s: %s", self._peer(), reason)
        out.append(frame(GOAWAY, 0, 0, struct.pack(">II", self.last_stream_id, code) + reason.encode()[:256]))
        transport = self.transport
        if transport is None or self._closing:
            return
        transport.write(b"".join(out))
        if self._write_paused or not transport.can_write_eof():
            self.close()
            return
        # Lingering close: send the GOAWAY and a FIN, then read (and drop) what the client still
        # sends for a moment, so that it reads the GOAWAY instead of a reset (a close with unread
        # input resets the connection).
        self._closing = True
        self._lingered = 0
        transport.write_eof()
        if self._reading_paused:
            transport.resume_reading()
        asyncio.get_running_loop().call_later(_LINGER, transport.close)

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

    def _frames(self) -> bool:
        """Handle the whole frames buffered, at most `frames_per_turn`; True if more are waiting."""
        buf = self._buf
        pos = 0
        if not self._preface:
            if len(buf) < len(PREFACE):
                if not PREFACE.startswith(bytes(buf)):
                    raise ProtocolError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                return False
            if buf[: len(PREFACE)] != PREFACE:
                raise ProtocolError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            pos = len(PREFACE)
            self._preface = True
        end = len(buf)
        max_frame = self.limits.max_frame_size
        budget = self.limits.frames_per_turn
        try:
            while end - pos >= 9:
                length = (buf[pos] << 16) | (buf[pos + 1] << 8) | buf[pos + 2]
                if length > max_frame:
                    raise ProtocolError(FRAME_SIZE_ERROR, f"frame of {length} bytes exceeds {max_frame}")
                if end - pos < 9 + length:
                    break
                if not budget:
                    return True
                budget -= 1
                kind = buf[pos + 3]
                flags = buf[pos + 4]
                stream_id = int.from_bytes(buf[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
                payload = bytes(buf[pos + 9 : pos + 9 + length])
                pos += 9 + length
                try:
                    self._frame(kind, flags, stream_id, payload)
                except _StreamError as exc:
                    self._stream_error(stream_id, exc.code)
                if self._closing:
                    return False
            return False
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
            if not payload and not flags & END_HEADERS:
                self._empty_frame()
            block[2].extend(payload)
            if len(block[2]) > 4 * self.limits.max_header_list_size:
                raise calm("header_block", "header block too large")
            if flags & END_HEADERS:
                self._headers_block = None
                self._header_block_done(block[0], block[1], bytes(block[2]))
        elif kind == RST_STREAM:
            self._on_rst_stream(stream_id, payload)
        elif kind == SETTINGS:
            self._on_settings(flags, stream_id, payload)
        elif kind == PING:
            if stream_id != 0 or len(payload) != 8:
                raise ProtocolError(FRAME_SIZE_ERROR if len(payload) != 8 else PROTOCOL_ERROR, "malformed PING")
            if not flags & ACK:
                if not self._pings.take():
                    raise calm("ping", "too many PINGs")
                self.write(frame(PING, ACK, 0, payload))
            elif payload == _GOAWAY_PING and self.goaway == "announced":
                self._final_goaway()
            elif payload == _IDLE_PING:
                self._alive_ping = False
        elif kind == WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
        elif kind == GOAWAY:
            if stream_id != 0 or len(payload) < 8:
                raise ProtocolError(PROTOCOL_ERROR, "malformed GOAWAY")
            # The client will open no new streams; the ones it has still get their answers.
        elif kind == PUSH_PROMISE:
            raise ProtocolError(PROTOCOL_ERROR, "clients may not push")
        elif kind == PRIORITY:
            if stream_id == 0:
                raise ProtocolError(PROTOCOL_ERROR, "PRIORITY on stream 0")
            if len(payload) != 5:
                raise _StreamError(FRAME_SIZE_ERROR, "PRIORITY of the wrong size")
            if not self._priorities.take():
                raise calm("priority", "too many PRIORITY frames")
            if int.from_bytes(payload[:4], "big") & 0x7FFFFFFF == stream_id:
                raise _StreamError(PROTOCOL_ERROR, "stream depends on itself")
        elif not self._priorities.take():  # unknown frame types are ignored (RFC 9113 §4.1)...
            raise calm("priority", "too many frames of unknown types")  # ... within reason

    def _empty_frame(self) -> None:
        self._empty_frames += 1
        if self._empty_frames > self.limits.empty_frames:
            raise calm("empty_frames", "too many empty frames")

    def _closed_stream(self, stream_id: int, kind: str) -> bool:
        """A frame on a stream that is not open: False if it is to be ignored.

        Idle streams (never opened) are a connection error; streams we reset ourselves get
        the client's late frames ignored; on any other closed stream, DATA and HEADERS are
        the client's mistake (it ended or reset the stream, or skipped its id)."""
        if stream_id > self.last_stream_id:
            raise ProtocolError(PROTOCOL_ERROR, f"{kind} on idle stream {stream_id}")
        return stream_id not in self._reset_ids

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ProtocolError(PROTOCOL_ERROR, "DATA on stream 0")
        flow = len(payload)  # padding counts against flow control too
        self._recv_window -= flow
        if self._recv_window < self._half_window:
            if self._recv_window < 0:
                raise ProtocolError(FLOW_CONTROL_ERROR, "DATA beyond the connection window")
            self._owed_limit = 0
        if flags & PADDED:
            payload = _unpad(payload)
        if payload or flags & END_STREAM:
            self._empty_frames = 0
        else:
            self._empty_frame()
        stream = self.streams.get(stream_id)
        if stream is None:
            self.release(flow)
            if self._closed_stream(stream_id, "DATA"):
                if not self._rsts.take():
                    raise calm("rst_stream", "too many frames on closed streams")
                self._refuse(stream_id, STREAM_CLOSED)
            return
        if stream.half_closed:
            self.release(flow)
            raise _StreamError(STREAM_CLOSED, "DATA after END_STREAM")
        stream._received(payload, bool(flags & END_STREAM), flow)

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ProtocolError(PROTOCOL_ERROR, "HEADERS on stream 0")
        self._empty_frames = 0
        if flags & PADDED:
            payload = _unpad(payload)
        if flags & PRIORITY_FLAG:
            if len(payload) < 5:
                raise ProtocolError(PROTOCOL_ERROR, "short HEADERS priority block")
            if int.from_bytes(payload[:4], "big") & 0x7FFFFFFF == stream_id:
                flags |= 0x100  # decoded first (the HPACK table must stay in step), then refused
            payload = payload[5:]
        if flags & END_HEADERS:
            self._header_block_done(stream_id, flags, payload)
        else:
            self._headers_block = (stream_id, flags, bytearray(payload))

    def _header_block_done(self, stream_id: int, flags: int, block: bytes) -> None:
        try:
            headers = self._decoder.decode(block)
        except HpackError as exc:
            if exc.costly:
                raise calm("hpack", str(exc)) from None
            raise ProtocolError(PROTOCOL_ERROR if exc.too_large else COMPRESSION_ERROR, str(exc)) from None
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers from the client: only allowed to end the stream
            if stream.half_closed:
                raise _StreamError(STREAM_CLOSED, "HEADERS after END_STREAM")
            if not flags & END_STREAM:
                raise ProtocolError(PROTOCOL_ERROR, "HEADERS in the middle of a stream")
            if any(name[:1] == b":" for name, _ in headers):
                raise _StreamError(PROTOCOL_ERROR, "pseudo-header in trailers")
            stream._received(b"", True)
            return
        if stream_id % 2 == 0:
            raise ProtocolError(PROTOCOL_ERROR, f"clients open odd streams, not {stream_id}")
        if stream_id <= self.last_stream_id:
            if self._closed_stream(stream_id, "HEADERS"):
                raise ProtocolError(STREAM_CLOSED, f"HEADERS on closed stream {stream_id}")
            return
        self.last_stream_id = stream_id
        if flags & 0x100:
            raise _StreamError(PROTOCOL_ERROR, "stream depends on itself")
        length = _check_request(headers)
        if self.goaway == "final" or len(self.streams) >= self.limits.max_concurrent_streams:
            self.server.refuse("stream_limit" if self.goaway is None else "draining")
            if not self._rsts.take():
                raise calm("rst_stream", "too many streams refused")
            self._refuse(stream_id, REFUSED_STREAM)
            return
        decoder = self._decoder
        decoder.huffman_budget = min(self.limits.huffman_burst, decoder.huffman_budget + self.limits.huffman_per_stream)
        try:
            stream = self.server.new_stream(self, stream_id, headers)
        except Exception:
            log.exception("could not start stream %d", stream_id)
            self._refuse(stream_id, INTERNAL_ERROR)
            return
        stream._opened = time.monotonic()
        if length is not None:
            stream._expected_length = length
        self.streams[stream_id] = stream
        if flags & END_STREAM:
            stream._received(b"", True)

    def _on_rst_stream(self, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ProtocolError(PROTOCOL_ERROR, "RST_STREAM on stream 0")
        if len(payload) != 4:
            raise ProtocolError(FRAME_SIZE_ERROR, "RST_STREAM of the wrong size")
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id > self.last_stream_id:
                raise ProtocolError(PROTOCOL_ERROR, f"RST_STREAM on idle stream {stream_id}")
            if not self._rsts.take():
                raise calm("rst_stream", "too many RST_STREAM frames")
            return
        if not stream.ended and time.monotonic() - stream._opened < self.limits.rapid_reset_seconds:
            self._premature_resets += 1
        self._drop(stream)
        self._check_rapid_resets()

    def _check_rapid_resets(self) -> None:
        """Envoy's rule: end a connection whose streams are mostly reset by it before an answer."""
        premature = self._premature_resets
        threshold = self.limits.rapid_reset_streams
        if self._streams_done < threshold:
            if premature * 2 < threshold:
                return
        elif premature * 2 < self._streams_done:
            return
        raise calm("rapid_reset", f"{premature} of {self._streams_done} streams reset before an answer")

    def _on_settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id != 0:
            raise ProtocolError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ProtocolError(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise ProtocolError(FRAME_SIZE_ERROR, "SETTINGS length not a multiple of 6")
        if not self._settings.take():
            raise calm("settings", "too many SETTINGS")
        for offset in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, offset)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ProtocolError(FLOW_CONTROL_ERROR, "initial window size too large")
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for stream in self.streams.values():
                    stream.send_window += delta
                    if stream.send_window > MAX_WINDOW:
                        raise ProtocolError(FLOW_CONTROL_ERROR, "a stream window overflows")
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
        sent = self.data_frames_sent - self._data_frames_seen
        if sent:
            self._data_frames_seen = self.data_frames_sent
            self._window_updates.earn(sent * self.limits.window_update_per_data)
        if not self._window_updates.take():
            raise calm("window_update", "too many WINDOW_UPDATE frames")
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
            if stream_id > self.last_stream_id:
                raise ProtocolError(PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {stream_id}")
            if increment == 0 and self._closed_stream(stream_id, "WINDOW_UPDATE"):
                raise _StreamError(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            return  # a late update for a stream we already closed
        if increment == 0:
            raise _StreamError(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
        if stream.send_window + increment > MAX_WINDOW:
            raise _StreamError(FLOW_CONTROL_ERROR, "stream window overflow")
        stream.send_window += increment
        if stream in self.blocked:
            stream._flush()

    def _unblock(self) -> None:
        for stream in list(self.blocked):
            if self.send_window <= 0:
                return
            stream._flush()


def _check_request(headers: list[tuple[bytes, bytes]]) -> int | None:
    """Raise _StreamError for a malformed request (RFC 9113 §8.2-8.3); its content-length, if any."""
    seen = 0
    regular = False
    length: int | None = None
    for name, value in headers:
        bit = _PSEUDO_BITS.get(name)
        if bit is not None:
            if regular or seen & bit:
                raise _StreamError(PROTOCOL_ERROR, "pseudo-header repeated or after a regular header")
            if bit == 4 and not value:
                raise _StreamError(PROTOCOL_ERROR, "empty :path")
            seen |= bit
            continue
        regular = True
        if name[:1] == b":":
            raise _StreamError(PROTOCOL_ERROR, "unknown or response pseudo-header")
        if not name.islower() and name.lower() != name:
            raise _StreamError(PROTOCOL_ERROR, "uppercase header name")
        special = _SPECIAL_HEADERS.get(name)
        if special is None:
            continue
        if special == 0:
            raise _StreamError(PROTOCOL_ERROR, "connection-specific header")
        if special == 1:
            if value != b"trailers":
                raise _StreamError(PROTOCOL_ERROR, "te other than trailers")
        elif not value.isdigit() or (length is not None and int(value) != length):
            raise _StreamError(PROTOCOL_ERROR, "bad content-length")
        else:
            length = int(value)
    if seen & 7 != 7:
        raise _StreamError(PROTOCOL_ERROR, "missing :method, :scheme or :path")
    return length


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

    def __init__(self, new_stream: NewStream, limits: H2Limits | None = None) -> None:
        self.new_stream = new_stream
        self.limits = limits or H2Limits()
        self.connections: set[Connection] = set()
        self.draining = False
        #: Connections, streams and connections ended for a limit, by the limit's name.
        self.refused: Counter[str] = Counter()
        #: Warnings about ended connections: a burst of 20, then one a second.
        self.log_budget = Budget(20, 1.0)
        self._servers: list[asyncio.Server] = []
        self._idle = asyncio.Event()

    def refuse(self, reason: str) -> None:
        self.refused[reason] += 1

    async def listen(self, address: str, *, serving: bool = True) -> str:
        """Listen on HOST:PORT or unix:PATH; returns the address actually bound. `serving=False`:
        bound only (a port some server listens on already is an error now), and connections are
        refused until `start_serving()`."""
        loop = asyncio.get_running_loop()
        if address.startswith("unix:"):
            path = address[len("unix:") :]
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            server = await loop.create_unix_server(
                lambda: Connection(self), path, backlog=_BACKLOG, start_serving=serving
            )
            self._servers.append(server)
            return address
        host, port = host_port(address)
        server = await loop.create_server(
            lambda: Connection(self), host, port, backlog=_BACKLOG, start_serving=serving
        )
        self._servers.append(server)
        bound = server.sockets[0].getsockname()[1]
        return f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"

    async def start_serving(self) -> None:
        """Accept connections on what `listen(serving=False)` bound (OSError: the port was taken
        meanwhile)."""
        for server in self._servers:
            if not server.is_serving():
                await server.start_serving()

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
