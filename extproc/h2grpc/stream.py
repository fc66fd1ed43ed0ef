"""One HTTP/2 stream as the application sees it (`Stream`): its hooks, and what it writes under
the peer's flow-control windows.

For each new stream the server's `new_stream` callback builds the `Stream` object from the decoded
request headers: an application protocol subclasses `Stream` (gRPC's `Call` does) and overrides its
hooks, `on_data` for each DATA payload, `on_end` when the client has sent everything, and `on_reset`
once if the stream is reset or the connection is lost before it ended. It answers with
`write_headers()`, `write_data()`, then `end()` with the last header block (or none). One object per
stream, on the event loop thread, without a task.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

from wakegate.extproc.h2grpc.frames import (
    DATA,
    END_HEADERS,
    END_STREAM,
    FRAME_HEADER,
    HEADERS,
    PROTOCOL_ERROR,
    WINDOW_REFILL,
    WINDOW_UPDATE,
    StreamError,
    frame,
)

if TYPE_CHECKING:
    from wakegate.extproc.h2grpc.connection import Connection

log = logging.getLogger("wakegate.extproc.h2")


#: `Stream.end(None)`: the stream ends with an empty DATA frame, not trailers.
_NO_TRAILERS = b""


def pick(headers: list[tuple[bytes, bytes]], *names: bytes) -> list[bytes]:
    """The values of `names` in a request's header list (b"" where absent; the last one wins)."""
    found = dict.fromkeys(names, b"")
    for name, value in headers:
        if name in found:
            found[name] = value
    return list(found.values())


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
        # Made when first needed: most streams never queue (a deque costs ~0.7 KB).
        self._pending: deque[memoryview] | None = None
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
        if self._pending is None:
            self._pending = deque()
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
        pending = self._pending
        while pending:
            data = pending[0]
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
                pending[0] = rest
            else:
                pending.popleft()
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
                raise StreamError(PROTOCOL_ERROR, "DATA does not match content-length")
        if not self.ended:
            self._recv_used += flow
            if self._recv_used >= WINDOW_REFILL:  # a very long stream: keep its window open
                conn.write(frame(WINDOW_UPDATE, 0, self.stream_id, FRAME_HEADER.pack(self._recv_used)))
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
        self._pending = None
        self._queued_end = None
        if not was_ended:
            try:
                self.on_reset()
            except Exception:
                log.exception("stream failed on reset")
