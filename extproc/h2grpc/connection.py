"""One HTTP/2 connection of the server (RFC 9113): framing, streams, flow control, draining, limits.

It knows nothing of gRPC; the application sees its streams (stream.py). What it speaks:
cleartext HTTP/2 with prior knowledge (no TLS, no server push, no priorities):

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
import logging
import struct
import time
from typing import TYPE_CHECKING, cast

from wakegate.extproc.h2grpc.frames import (
    ACK,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    DEFAULT_FRAME_SIZE,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    FLOW_CONTROL_ERROR,
    FRAME_HEADER,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    INTERNAL_ERROR,
    MAX_WINDOW,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    SETTINGS_ENABLE_PUSH,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    SETTINGS_MAX_FRAME_SIZE,
    SETTINGS_MAX_HEADER_LIST_SIZE,
    STREAM_CLOSED,
    WINDOW_UPDATE,
    ProtocolError,
    StreamError,
    calm,
    frame,
    unpad,
)
from wakegate.extproc.h2grpc.hpack import HeaderDecoder, HpackError
from wakegate.extproc.h2grpc.limits import Budget
from wakegate.extproc.h2grpc.request_check import check_request
from wakegate.extproc.h2grpc.stream import Stream

if TYPE_CHECKING:
    from wakegate.extproc.h2grpc.server import H2Server


log = logging.getLogger("wakegate.extproc.h2")

_GOAWAY_PING = b"wg-drain"
_IDLE_PING = b"wg-alive"

#: Stream ids we reset ourselves, remembered so that the client's late frames on them are
#: ignored (RFC 9113 §5.1, "closed") rather than answered as errors.
_RESET_MEMORY = 1024

#: Seconds a connection we ended keeps being read (and dropped) before it is closed, and
#: bytes at most (a client that keeps sending gets no more of our reading).
_LINGER = 0.2
_LINGER_BYTES = 256 * 1024
#: Unhandled input (frames left for the next turn) above which we stop reading the connection.
_READ_AHEAD = 256 * 1024


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
            out += frame(WINDOW_UPDATE, 0, 0, FRAME_HEADER.pack(limits.connection_window - DEFAULT_WINDOW))
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
            self.write(frame(WINDOW_UPDATE, 0, 0, FRAME_HEADER.pack(owed)))
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
                except StreamError as exc:
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
                raise StreamError(FRAME_SIZE_ERROR, "PRIORITY of the wrong size")
            if not self._priorities.take():
                raise calm("priority", "too many PRIORITY frames")
            if int.from_bytes(payload[:4], "big") & 0x7FFFFFFF == stream_id:
                raise StreamError(PROTOCOL_ERROR, "stream depends on itself")
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
            payload = unpad(payload)
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
            raise StreamError(STREAM_CLOSED, "DATA after END_STREAM")
        stream._received(payload, bool(flags & END_STREAM), flow)

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ProtocolError(PROTOCOL_ERROR, "HEADERS on stream 0")
        self._empty_frames = 0
        if flags & PADDED:
            payload = unpad(payload)
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
                raise StreamError(STREAM_CLOSED, "HEADERS after END_STREAM")
            if not flags & END_STREAM:
                raise ProtocolError(PROTOCOL_ERROR, "HEADERS in the middle of a stream")
            if any(name[:1] == b":" for name, _ in headers):
                raise StreamError(PROTOCOL_ERROR, "pseudo-header in trailers")
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
            raise StreamError(PROTOCOL_ERROR, "stream depends on itself")
        length = check_request(headers)
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
                raise StreamError(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            return  # a late update for a stream we already closed
        if increment == 0:
            raise StreamError(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
        if stream.send_window + increment > MAX_WINDOW:
            raise StreamError(FLOW_CONTROL_ERROR, "stream window overflow")
        stream.send_window += increment
        if stream in self.blocked:
            stream._flush()

    def _unblock(self) -> None:
        for stream in list(self.blocked):
            if self.send_window <= 0:
                return
            stream._flush()
