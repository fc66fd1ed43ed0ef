"""Parked cold requests: held at this extproc's HTTP/2 port, not in their ext_proc streams.

A cold request whose body Envoy already holds (or that has none) is not kept waiting in its
ext_proc stream: the Processor answers it at once with a route to the park (CLUSTER_HEADER =
PARK_CLUSTER) and a signed park ticket (model, name, deadline). Envoy's park route sends it to the
extproc cluster, where `Parker` takes it as a plain HTTP/2 request (the gRPC server hands it every
stream that is not gRPC) and waits in the model's cold queue like any held request. When the model
is ready it answers 307 with a release ticket; the park route follows that redirect inside Envoy
(the client sees nothing), and the request goes through the filter chain again: extproc decides it
as new, except that a valid release ticket for the same model spares it the rate limit and token
budget it passed the first time, and a request that was parked once is never parked again (it
would meet Envoy's one-redirect limit). A refusal while parked (activation timeout or failure, a
full queue) is the same OpenAI-shaped answer the ext_proc stream would have given.

What it saves: Envoy keeps no ext_proc stream (nor its retry copy) per held request, only the
router's upstream stream to the park, and this process keeps a stream object and a task
(docs/performance.md, "Scale"). If the parking extproc dies the stream is reset, and the park
route retries it on the other extproc; one that is stopping answers the unserved 503, which the
route retries there too. A ticket this process cannot verify (the other extproc's, with no shared
internal token) is answered with an unverified release: the request is decided anew, held in its
ext_proc stream if its model is still cold.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from wakegate.contract import PARK_HEADER, RELEASE_HEADER
from wakegate.extproc.cold import ActivationFailed, ModelQueue, QueueFull
from wakegate.extproc.exchange import STOPPING
from wakegate.extproc.h2grpc.connection import Connection
from wakegate.extproc.h2grpc.hpack import literal
from wakegate.extproc.h2grpc.stream import Stream, pick

if TYPE_CHECKING:
    from wakegate.extproc.service import Processor

log = logging.getLogger("wakegate.extproc.park")

#: How long a release ticket lets its request skip the admission it already passed: the redirect
#: comes back within milliseconds; a copy replayed later is decided as any other request.
RELEASE_SECONDS = 30.0

_PARK = PARK_HEADER.encode()
_RELEASE = RELEASE_HEADER.encode()


class Tickets:
    """Signed tickets, `<expiry ms>:<kind-bound MAC>:<key>:<name>` (key and name percent-quoted).

    The secret is derived from the gateway's internal token, which both extprocs share (a ticket
    one signs, the other verifies); without one it is random per process."""

    def __init__(self, secret: bytes | None = None, clock: Callable[[], float] = time.time) -> None:
        self._secret = secret if secret else secrets.token_bytes(32)
        self._clock = clock

    @classmethod
    def from_token(cls, token: str | None) -> Tickets:
        secret = hmac.new(token.encode(), b"wakegate park tickets", hashlib.sha256).digest() if token else None
        return cls(secret)

    def _mac(self, kind: str, body: str) -> str:
        return hmac.new(self._secret, f"{kind}\0{body}".encode(), hashlib.sha256).hexdigest()[:32]

    def _sign(self, kind: str, expiry: float, key: str, name: str) -> str:
        expiry_ms, named = int(expiry * 1000), f"{quote(key, safe='')}:{quote(name, safe='')}"
        return f"{expiry_ms}:{self._mac(kind, f'{expiry_ms}:{named}')}:{named}"

    def park(self, key: str, name: str, deadline: float) -> str:
        """A park ticket: the request of model `key` (asked for as `name`) may wait until `deadline`
        (wall-clock seconds)."""
        return self._sign("park", deadline, key, name)

    def release(self, key: str, name: str) -> str:
        return self._sign("release", self._clock() + RELEASE_SECONDS, key, name)

    def read(self, kind: str, ticket: str) -> tuple[str, str, float] | None:
        """(key, name, expiry) of a valid, unexpired ticket of `kind`; None for anything else."""
        parts = ticket.split(":")
        if len(parts) != 4:
            return None
        expiry_ms, mac, key, name = parts
        if not expiry_ms.isdigit() or not hmac.compare_digest(mac, self._mac(kind, f"{expiry_ms}:{key}:{name}")):
            return None
        expiry = int(expiry_ms) / 1000
        if kind == "release" and expiry < self._clock():
            return None
        return unquote(key), unquote(name), expiry


class Parked(Stream):
    """One parked request: where it goes back to, and until when it waits. Its body is not kept
    (Envoy holds it for the redirect)."""

    __slots__ = ("deadline", "group", "location", "name")

    def __init__(self, conn: Connection, stream_id: int, location: bytes) -> None:
        super().__init__(conn, stream_id)
        self.location = location
        self.name = ""
        self.deadline = 0.0
        self.group: _Group | None = None

    def on_reset(self) -> None:
        # Envoy gave up on it (its client went away): it leaves the queue now.
        if self.group is not None:
            self.group.leave(self)


def _headers(status: int, fields: list[tuple[bytes, bytes]]) -> bytes:
    return literal(b":status", str(status).encode()) + b"".join(literal(k, v) for k, v in fields)


#: Parked requests released per turn of the event loop (as extproc/cold.py's ReleaseGate does for
#: held streams): between two batches the loop reads its sockets, Envoy's keepalive pings among them.
RELEASE_BATCH = 128
#: Released requests not yet back at an ext_proc stream: at most this many. A released request
#: is decided twice more (its headers, then its body) after its 307; sent back all at once,
#: 10,000 of them queued every first message ahead of anyone's second, and the first answer came
#: 1.3-2.7 s after the model was ready instead of ~0.1 s (docs/performance.md, "Scale").
RELEASE_WINDOW = 256
#: A window that saw no released request come back for this long is opened again (they went to
#: the other extproc, or their clients left).
RELEASE_STALL_SECONDS = 1.0


class _Group:
    """The requests parked for one model while one activation is awaited (one `ready` future of
    its cold queue): no task per request, one timer for the earliest deadline, in arrival order."""

    __slots__ = ("generation", "key", "parker", "queue", "ready", "streams", "timer")

    def __init__(self, parker: Parker, key: str, queue: ModelQueue) -> None:
        self.parker = parker
        self.key = key
        self.queue = queue
        self.generation = queue.generation
        self.ready = queue.ready
        #: In arrival order: a dict, so a request whose client went away leaves in O(1).
        self.streams: dict[Parked, None] = {}
        self.timer: asyncio.TimerHandle | None = None
        queue.ready.add_done_callback(self._ready)

    def add(self, stream: Parked) -> None:
        self.streams[stream] = None
        stream.group = self
        if self.timer is None:
            self._arm()

    def leave(self, stream: Parked) -> None:
        if self.streams.pop(stream, 0) is None:
            stream.group = None
            gw = self.parker.processor.gw
            gw.cold.left(self.queue, self.generation)
            gw.metrics.queue_depth.labels(self.key).dec()

    def _arm(self) -> None:
        """A timer for the first request's deadline. Deadlines follow arrival (one model's activation
        timeout), so the first is the earliest; one that came later with a shorter timeout (its
        Model changed meanwhile) is answered when the ones before it are."""
        if self.streams:
            first = next(iter(self.streams))
            self.timer = asyncio.get_running_loop().call_later(first.deadline - time.monotonic(), self._expire)
        else:
            self.timer = None

    def _expire(self) -> None:
        now = time.monotonic()
        proc = self.parker.processor
        route = proc.gw.table.routes.get(self.key)
        seconds = (route.cold.activation_timeout_ms if route is not None else 0) // 1000
        while self.streams:
            stream = next(iter(self.streams))
            if stream.deadline > now:
                break
            self.leave(stream)
            message = f"model {stream.name!r} did not become ready within {seconds}s"
            _reply(stream, proc._reject(self.key, 503, "activation_timeout", message))
        self._arm()

    def _ready(self, ready: asyncio.Future[None]) -> None:
        """The activation ended: release every request (in batches), or answer each with its failure."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.parker.groups.get(self.key) is self:
            del self.parker.groups[self.key]
        streams, self.streams = list(self.streams), {}
        for stream in streams:
            stream.group = None
        failed = ready.exception()
        proc = self.parker.processor
        proc.gw.metrics.queue_depth.labels(self.key).dec(len(streams))
        if isinstance(failed, ActivationFailed):
            # The failure let go of their count already (the queue's generation moved on).
            retry_after = str(proc.gw.settings.cold_retry_after)
            for stream in streams:
                _reply(stream, proc._reject(self.key, 503, failed.code, failed.answer(stream.name),
                                            retry_after=retry_after))  # fmt: skip
            return
        proc.gw.cold.left(self.queue, self.generation, len(streams))
        self.parker.release(self.key, streams)


def _reply(stream: Stream, response: ep.ProcessingResponse) -> None:
    """An extproc refusal (an ImmediateResponse) as the park's own HTTP answer."""
    answer = response.immediate_response
    fields = [(h.header.key.encode(), h.header.raw_value or h.header.value.encode())
              for h in answer.headers.set_headers]  # fmt: skip
    stream.write_headers(_headers(answer.status.code, fields))
    stream.write_data(answer.body)
    stream.end(None)


class Parker:
    """Holds the parked requests of one extproc (its gRPC server's non-gRPC streams)."""

    def __init__(self, processor: Processor, tickets: Tickets) -> None:
        self.processor = processor
        self.tickets = tickets
        #: model key -> the group of its current activation.
        self.groups: dict[str, _Group] = {}
        self._releasing: collections.deque[tuple[str, Parked]] = collections.deque()
        #: Sent back and not seen again yet (RELEASE_WINDOW).
        self._out = 0
        self._scheduled = False
        self._stall: asyncio.TimerHandle | None = None
        processor.on_released = self.back

    @property
    def parked(self) -> int:
        return sum(len(group.streams) for group in self.groups.values())

    def stream(self, conn: Connection, stream_id: int, headers: list[tuple[bytes, bytes]]) -> Stream | None:
        """The stream of a parked request; None for a request without a park ticket (not ours)."""
        ticket, authority, path, scheme = pick(headers, _PARK, b":authority", b":path", b"x-forwarded-proto")
        if not ticket:
            return None
        stream = Parked(conn, stream_id, (scheme or b"http") + b"://" + authority + path)
        read = self.tickets.read("park", ticket.decode("ascii", "replace"))
        if read is None:
            # Not ours to verify: sent back to be decided anew, unreleased.
            self._send_back(stream, b"-")
            return stream
        key, stream.name, deadline = read
        stream.deadline = time.monotonic() + (deadline - time.time())
        proc = self.processor
        route = proc.gw.table.routes.get(key)
        if route is None or route.endpoints:
            # Gone, or ready since: decided again at once (a 404, or routed).
            self._send_back(stream, self.tickets.release(key, stream.name).encode())
            return stream
        try:
            queue = proc.gw.cold.join(route)
        except QueueFull:
            _reply(stream, proc._queue_full(route))
            return stream
        group = self.groups.get(key)
        if group is None or group.ready is not queue.ready:
            group = self.groups[key] = _Group(self, key, queue)
        group.add(stream)
        proc.gw.metrics.queue_depth.labels(key).inc()
        return stream

    def release(self, key: str, streams: list[Parked]) -> None:
        """Send `streams` back to the gateway: at most RELEASE_BATCH per turn of the loop and
        RELEASE_WINDOW not yet back, in the order they came."""
        self._releasing.extend((key, stream) for stream in streams)
        self._schedule()

    def back(self) -> None:
        """A released request reached an ext_proc stream of this extproc again (Processor)."""
        if self._out:
            self._out -= 1
            if self._stall is not None:
                self._stall.cancel()
                self._stall = None
            self._schedule()

    def _schedule(self) -> None:
        if self._releasing and not self._scheduled and self._out < RELEASE_WINDOW:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._release_some)

    def _release_some(self) -> None:
        self._scheduled = False
        releasing = self._releasing
        sent = 0
        while releasing and sent < RELEASE_BATCH and self._out < RELEASE_WINDOW:
            key, stream = releasing.popleft()
            if stream.closed:
                continue  # its client left after the model was ready
            self._send_back(stream, self.tickets.release(key, stream.name).encode())
            self._out += 1
            sent += 1
        if not releasing:
            return
        if self._out < RELEASE_WINDOW:
            self._schedule()
        elif self._stall is None:
            self._stall = asyncio.get_running_loop().call_later(RELEASE_STALL_SECONDS, self._stalled)

    def _stalled(self) -> None:
        self._stall = None
        self._out = 0
        self._schedule()

    def _send_back(self, stream: Parked, ticket: bytes) -> None:
        """307 to the same URL, headers only: Envoy's park route follows it inside the gateway."""
        stream.end(_headers(307, [(b"location", stream.location), (_RELEASE, ticket)]))

    def let_go(self) -> int:
        """Stopping: answer every parked request with the unserved 503, which the park route
        retries on the other extproc."""
        count = 0
        for group in list(self.groups.values()):
            for stream in list(group.streams):
                group.leave(stream)
                _reply(stream, STOPPING)
                count += 1
        return count
