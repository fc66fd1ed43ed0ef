"""The HTTP/2 server: listening, serving, counting refusals, and stopping with a drain."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import Counter
from collections.abc import Callable

from wakegate.extproc.h2grpc.connection import Connection
from wakegate.extproc.h2grpc.limits import Budget, H2Limits
from wakegate.extproc.h2grpc.stream import Stream
from wakegate.process import host_port

log = logging.getLogger("wakegate.extproc.h2")


#: Accept queue: a burst of connections (an attack, or many at once) must not make Envoy's own
#: connect wait for a SYN retry (its connect timeout to extproc is 1 s). The kernel caps it at
#: net.core.somaxconn.
_BACKLOG = 4096




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
