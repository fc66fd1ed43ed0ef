"""A TCP front for the feeder's gRPC server that cuts HTTP/2 control-frame floods.

grpcio's server (grpc-core's chttp2) answers every SETTINGS frame with an ACK and has no
limit on how many a client sends; its PING limit (too_many_pings) sends a GOAWAY but closes
the connection only once the backlog the client wrote is worked through, which under a flood
takes a core for many seconds, or never, when the client goes quiet without closing. So the
feeder's xDS port is this front: it accepts the client's connection, reads the header of each
frame the client sends (nothing else: payloads are passed through unread) and forwards the
bytes to grpcio on a loopback port of its own. A connection whose PING or SETTINGS frames
overrun their budget (a burst, then a rate, per connection) is closed at once, both ways.

What the server sends back is forwarded untouched. Every other limit (streams, message
sizes, rapid reset) stays grpc-core's own (`GRPC_OPTIONS`). `serve_guarded` puts any grpc.aio
server behind a guard: the feeder's ADS server and the scaler's demand port use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import grpc

log = logging.getLogger("wakegate.xds")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_SETTINGS, _PING = 0x4, 0x6
_ACK = 0x1
_CHUNK = 256 * 1024

#: grpc-core's own limits for the server behind the front (see docs/reliability.md).
GRPC_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    # An Envoy or an extproc holds one ADS stream per connection (plus a demand stream).
    ("grpc.max_concurrent_streams", 100),
]


@dataclass(frozen=True)
class FrameBudget:
    """Per connection: how many PING and SETTINGS frames (not ACKs) a client may send at once,
    and how many a second after that. A well-behaved client sends one SETTINGS and, while it
    receives, a few PINGs (grpc's BDP probes, Envoy's keepalives); extproc's own HTTP/2
    server has the same defaults."""

    ping_burst: int = 100
    ping_per_second: float = 10.0
    settings_burst: int = 100
    settings_per_second: float = 10.0


class _Bucket:
    __slots__ = ("burst", "last", "rate", "tokens")

    def __init__(self, burst: int, rate: float) -> None:
        self.burst = self.tokens = float(burst)
        self.rate = rate
        self.last = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class FrameCounter:
    """Follows the frames of one client's byte stream, chunk by chunk; `feed` says when one
    of them overran its budget ("ping", "settings") or the stream is not HTTP/2 ("preface")."""

    def __init__(self, budget: FrameBudget) -> None:
        self._preface = 0  # bytes of the preface seen so far
        self._skip = 0  # payload bytes of the current frame still to pass
        self._partial = b""  # the start of a frame header split across chunks
        self._ping = _Bucket(budget.ping_burst, budget.ping_per_second)
        self._settings = _Bucket(budget.settings_burst, budget.settings_per_second)

    def feed(self, data: bytes) -> str | None:
        i, n = 0, len(data)
        if self._preface < len(PREFACE):
            take = min(len(PREFACE) - self._preface, n)
            if data[:take] != PREFACE[self._preface : self._preface + take]:
                return "preface"
            self._preface += take
            i = take
        if self._skip:
            step = min(self._skip, n - i)
            i += step
            self._skip -= step
        while i < n:
            if self._partial:
                need = 9 - len(self._partial)
                self._partial += data[i : i + need]
                i += need
                if len(self._partial) < 9:
                    return None
                header, self._partial = self._partial, b""
            elif n - i >= 9:
                header = data[i : i + 9]
                i += 9
            else:
                self._partial = data[i:]
                return None
            kind, flags = header[3], header[4]
            if not flags & _ACK:
                if kind == _PING and not self._ping.take():
                    return "ping"
                if kind == _SETTINGS and not self._settings.take():
                    return "settings"
            length = int.from_bytes(header[:3], "big")
            step = min(length, n - i)
            i += step
            self._skip = length - step
        return None


@dataclass
class GuardStats:
    connections: int = 0
    #: connections closed by reason ("ping", "settings", "preface")
    cut: dict[str, int] = field(default_factory=dict)


class FrameGuard:
    """Listens where the gRPC server should be reachable and forwards to it (`upstream`: a
    loopback port), ending a connection that overruns its `FrameBudget`."""

    def __init__(self, upstream: tuple[str, int], budget: FrameBudget | None = None) -> None:
        self._upstream = upstream
        self._budget = budget or FrameBudget()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.stats = GuardStats()
        self._log_budget = _Bucket(20, 1.0)  # warning lines: 20, then one a second

    async def listen(self, host: str, port: int) -> int:
        """Start listening; returns the bound port."""
        self._server = await asyncio.start_server(self._accepted, host or None, port, limit=_CHUNK)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop listening and end every connection."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _accepted(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        # The connection's task ends normally even when close() cancels it: asyncio's stream
        # server (Python 3.11) calls task.exception() on it when it is done, which raises for a
        # cancelled task, and the loop logs that as an "Exception in callback" ERROR with a
        # traceback (every connection open when the feeder stopped).
        with contextlib.suppress(asyncio.CancelledError):
            await self._connection(client_r, client_w)

    async def _connection(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.stats.connections += 1
        peer = client_w.get_extra_info("peername")
        try:
            try:
                server_r, server_w = await asyncio.open_connection(*self._upstream, limit=_CHUNK)
            except OSError:
                return
            back = asyncio.create_task(self._pipe(server_r, client_w))
            try:
                reason = await self._inbound(client_r, server_w)
                if reason is not None:
                    self.stats.cut[reason] = self.stats.cut.get(reason, 0) + 1
                    if self._log_budget.take():
                        log.warning("xds connection from %s closed: %s over budget (%s)", peer, reason, self.stats.cut)
                    client_w.transport.abort()
                    server_w.transport.abort()
                else:
                    with contextlib.suppress(OSError):
                        await back
            finally:
                back.cancel()
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await back
                server_w.close()
        finally:
            client_w.close()
            self._tasks.discard(task)

    async def _inbound(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str | None:
        """Client to server: forward what the client sends while its frames stay in budget."""
        counter = FrameCounter(self._budget)
        with contextlib.suppress(OSError):
            while data := await reader.read(_CHUNK):
                reason = counter.feed(data)
                if reason is not None:
                    return reason
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        return None

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Server to client, untouched; the client's side ends when the server's does."""
        try:
            while data := await reader.read(_CHUNK):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()


class GuardedServer:
    """A grpc.aio server on a loopback port of its own, reached through its `FrameGuard`."""

    def __init__(self, server: grpc.aio.Server, guard: FrameGuard) -> None:
        self.server = server
        self.guard = guard

    async def stop(self, grace: float | None) -> None:
        await self.guard.close()
        await self.server.stop(grace)


async def serve_guarded(
    server: grpc.aio.Server, listen: str, budget: FrameBudget | None = None
) -> tuple[GuardedServer, int]:
    """Start `server` (its services added, no port yet) on a loopback port and a guard in front
    of it on `listen` (HOST:PORT, [V6]:PORT); returns both and the guard's bound port. Raises
    OSError when `listen` cannot be bound."""
    inner = server.add_insecure_port("127.0.0.1:0")
    host, _, port = listen.rpartition(":")
    guard = FrameGuard(("127.0.0.1", inner), budget)
    try:
        bound = await guard.listen(host.strip("[]"), int(port))
    except (OSError, ValueError) as exc:
        raise OSError(f"cannot listen on {listen}: {exc}") from exc
    await server.start()
    return GuardedServer(server, guard), bound
