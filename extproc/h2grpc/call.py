"""The gRPC side of the server: calls over HTTP/2 streams, and the server that routes them by method.

gRPC framing only (no compression): 5-byte length-prefixed messages, a response headers
block, trailers with grpc-status and a percent-encoded grpc-message, trailers-only
responses for calls refused up front. A request that is not gRPC at all (another method or
content-type) gets a plain HTTP answer: 405 or 415 with a one-line text body, as the gRPC
over HTTP/2 protocol asks of a server.

A call is served by a listener the method's factory returns. The server calls its
`on_message` for each whole request message, `on_half_close` when the client has sent
everything, and `on_cancel` once if the stream is reset or the connection is lost before
the call finished. The listener answers through its `Call`: `send()` then `finish()`. All
of this runs on the event loop thread, without a task per call: a listener that must wait
starts its own task.
"""

from __future__ import annotations

import logging
import struct
import urllib.parse
from collections.abc import Callable
from typing import Protocol

from wakegate.extproc.h2grpc.connection import Connection
from wakegate.extproc.h2grpc.hpack import STATUS_200, literal
from wakegate.extproc.h2grpc.limits import H2Limits
from wakegate.extproc.h2grpc.server import H2Server
from wakegate.extproc.h2grpc.stream import Stream, pick

log = logging.getLogger("wakegate.extproc.h2")

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

_LENGTH = struct.Struct(">I")
_RESPONSE_HEADERS = STATUS_200 + literal(b"content-type", b"application/grpc")
_OK_TRAILERS = literal(b"grpc-status", b"0")
_NOT_GRPC = b"this server speaks only gRPC (POST, content-type application/grpc)\n"


def _grpc_message(text: str) -> bytes:
    # gRPC percent-encodes grpc-message as UTF-8; keep printable ASCII except '%'.
    return urllib.parse.quote(text, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode("ascii")


def _trailers(status: int, message: str) -> bytes:
    block = literal(b"grpc-status", str(status).encode())
    if message:
        block += literal(b"grpc-message", _grpc_message(message))
    return block


class Listener(Protocol):
    def on_message(self, data: bytes) -> None: ...
    def on_half_close(self) -> None: ...
    def on_cancel(self) -> None: ...


#: Builds the listener of one call to a method.
Method = Callable[["Call"], Listener]


class Call(Stream):
    """One gRPC call: an HTTP/2 stream speaking gRPC, as its listener sees it."""

    __slots__ = ("_max_message", "_recv", "_sent_headers", "listener", "method")

    def __init__(self, conn: Connection, stream_id: int, method: str, max_message_bytes: int) -> None:
        super().__init__(conn, stream_id)
        self.method = method
        self._max_message = max_message_bytes
        self.listener: Listener | None = None
        self._recv = bytearray()
        self._sent_headers = False

    @property
    def finished(self) -> bool:
        """We sent our status (or the stream is gone): nothing more goes out."""
        return self.ended

    def send(self, message: bytes) -> None:
        """Queue one response message; it goes out as the client's flow-control windows allow."""
        if self.ended:
            return
        if not self._sent_headers:
            self._sent_headers = True
            self.write_headers(_RESPONSE_HEADERS)
        self.write_data(b"\x00" + _LENGTH.pack(len(message)) + message)

    def finish(self, status: int = OK, message: str = "") -> None:
        """End the call with a gRPC status; response messages still queued go out first."""
        if self.ended:
            return
        block = _OK_TRAILERS if status == OK and not message else _trailers(status, message)
        if not self._sent_headers:
            # Trailers-only response: one HEADERS frame with the status.
            self._sent_headers = True
            block = _RESPONSE_HEADERS + block
        self.end(block)

    def reply_http(self, status: int, text: bytes) -> None:
        """Answer a request that is not gRPC with a plain HTTP status and a text body."""
        if self.ended:
            return
        self._sent_headers = True
        self.write_headers(literal(b":status", str(status).encode()) + literal(b"content-type", b"text/plain"))
        self.write_data(text)
        self.end(None)

    # -- Stream hooks ---------------------------------------------------------------------------

    def buffered(self) -> int:
        return len(self._recv)

    def on_data(self, data: bytes) -> None:
        buf = self._recv
        buf += data
        while len(buf) >= 5:
            length = int.from_bytes(buf[1:5], "big")
            if buf[0] != 0:
                self._fail(UNIMPLEMENTED, "compressed messages are not supported")
                return
            if length > self._max_message:
                self._fail(RESOURCE_EXHAUSTED, f"message of {length} bytes exceeds {self._max_message}")
                return
            if len(buf) < 5 + length:
                break
            message = bytes(buf[5 : 5 + length])
            del buf[: 5 + length]
            self._deliver(message)
            if self.ended:
                return

    def on_end(self) -> None:
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

    def on_reset(self) -> None:
        """The stream is gone before the call finished: the listener hears `on_cancel`."""
        self._cancel_listener()

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
        already = self.ended
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


class GrpcServer:
    """Serves gRPC methods (full names, '/package.Service/Method') over `H2Server`."""

    def __init__(
        self,
        methods: dict[str, Method],
        *,
        max_message_bytes: int = 4 * 1024 * 1024,
        limits: H2Limits | None = None,
        http: Callable[[Connection, int, list[tuple[bytes, bytes]]], Stream | None] | None = None,
    ) -> None:
        self.methods = dict(methods)
        #: Offered every request that is not gRPC first: its stream, or None to refuse it (415).
        self.http = http
        self.max_message_bytes = max_message_bytes
        self.transport = H2Server(self._new_call, limits)

    async def listen(self, address: str, *, serving: bool = True) -> str:
        """Listen on HOST:PORT or unix:PATH; returns the address actually bound. `serving=False`:
        connections are refused until `start_serving()`."""
        return await self.transport.listen(address, serving=serving)

    async def start_serving(self) -> None:
        await self.transport.start_serving()

    async def stop(self, grace: float) -> None:
        """Refuse new calls, let the open ones finish for up to `grace` seconds, then cut them."""
        await self.transport.stop(grace)

    @property
    def active_calls(self) -> int:
        return self.transport.active_streams

    def _new_call(self, conn: Connection, stream_id: int, headers: list[tuple[bytes, bytes]]) -> Stream:
        path, method, content_type = pick(headers, b":path", b":method", b"content-type")
        grpc = content_type.startswith(b"application/grpc")
        if not grpc and self.http is not None:
            stream = self.http(conn, stream_id, headers)
            if stream is not None:
                return stream
        call = Call(conn, stream_id, path.decode("ascii", "replace"), self.max_message_bytes)
        factory = self.methods.get(call.method)
        if not grpc:
            call.reply_http(415, _NOT_GRPC)
        elif method != b"POST":
            call.reply_http(405, _NOT_GRPC)
        elif factory is None:
            call.finish(UNIMPLEMENTED, f"unknown method {call.method}")
        else:
            try:
                call.listener = factory(call)
            except Exception:
                log.exception("could not start a call to %s", call.method)
                call.finish(INTERNAL, "internal error")
        return call
