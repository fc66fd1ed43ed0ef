"""What one client may make the HTTP/2 server do: the limits, and the token buckets that keep them.

The server's only real client is Envoy on the same machine, which never comes near any of
these; they are there for a peer that is broken or hostile, so that one connection can cost
the process only a bounded share of memory and CPU. Each is a field of `H2Limits`, set on
the command line as `--h2-limit NAME=VALUE` (docs/decisions.md has why each default is what
it is). A connection that overruns a budget is ended with GOAWAY ENHANCE_YOUR_CALM, and the
server counts it by reason.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class H2Limits:
    """Per-connection (and per-server, where named so) limits of the HTTP/2 server."""

    #: Streams open at once on one connection; advertised as SETTINGS_MAX_CONCURRENT_STREAMS.
    max_concurrent_streams: int = 1000
    #: Connections the server holds at once; one more is closed as soon as it is accepted.
    max_connections: int = 1000
    #: Largest frame payload we accept; advertised as SETTINGS_MAX_FRAME_SIZE.
    max_frame_size: int = 16_384
    #: Largest decoded header list (RFC 7541 sizes); advertised as SETTINGS_MAX_HEADER_LIST_SIZE.
    max_header_list_size: int = 64 * 1024
    #: Huffman-coded bytes one header block may hold (decoding is ~0.3 µs a byte in Python).
    huffman_per_block: int = 8 * 1024
    #: Huffman-coded bytes a connection may have decoded beyond what its streams earned...
    huffman_burst: int = 16 * 1024
    #: ... and what each stream it opens earns it.
    huffman_per_stream: int = 256
    #: Received DATA a connection may have buffered in unfinished messages (its receive window).
    connection_window: int = 64 * 1024 * 1024
    #: Unsent output above which we stop reading the connection until the client drains it.
    write_buffer: int = 4 * 1024 * 1024
    #: Frames handled per turn of the event loop before other connections get theirs.
    frames_per_turn: int = 100
    #: PING frames: burst, then per second.
    ping_burst: int = 100
    ping_per_second: float = 10.0
    #: SETTINGS frames: burst, then per second.
    settings_burst: int = 100
    settings_per_second: float = 10.0
    #: RST_STREAM frames that end nothing open, and streams we refuse: burst, then per second.
    rst_burst: int = 1000
    rst_per_second: float = 100.0
    #: WINDOW_UPDATE frames: burst, per second, and per DATA frame we send.
    window_update_burst: int = 1000
    window_update_per_second: float = 100.0
    window_update_per_data: int = 10
    #: PRIORITY frames and frames of unknown types: burst, then per second.
    priority_burst: int = 1000
    priority_per_second: float = 100.0
    #: Empty DATA / CONTINUATION frames in a row that end nothing.
    empty_frames: int = 10
    #: Rapid reset: a stream the client resets within this many seconds of opening it, before
    #: we answered it, is premature; ...
    rapid_reset_seconds: float = 1.0
    #: ... a connection with half its streams reset prematurely, counted once this many streams
    #: ended (or once half this many were premature), is ended.
    rapid_reset_streams: int = 500
    #: Seconds from accepting a connection to its complete client preface.
    preface_timeout: float = 10.0
    #: Seconds without a frame from the client before a connection without streams is closed
    #: (gracefully), and a connection with streams is asked for a PING it must answer within
    #: as long again.
    idle_timeout: float = 300.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value <= 0:
                raise ValueError(f"h2 limit {f.name} must be positive, not {value}")
        if not 16_384 <= self.max_frame_size <= 2**24 - 1:
            raise ValueError("h2 limit max_frame_size must be within 16384..16777215")
        if not 65_535 <= self.connection_window <= 2**31 - 1:
            raise ValueError("h2 limit connection_window must be within 65535..2147483647")

    def with_overrides(self, items: list[str] | tuple[str, ...]) -> H2Limits:
        """These limits with NAME=VALUE items applied (as `--h2-limit` gives them)."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        changes: dict[str, float | int] = {}
        for item in items:
            name, sep, raw = item.partition("=")
            name = name.strip().replace("-", "_")
            if not sep or name not in fields:
                raise ValueError(f"unknown h2 limit {item!r} (known: {', '.join(fields)})")
            kind = type(getattr(self, name))
            try:
                changes[name] = kind(float(raw)) if kind is float else int(raw)
            except ValueError:
                raise ValueError(f"h2 limit {name} takes a number, not {raw!r}") from None
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def names(cls) -> str:
        """NAME=DEFAULT for every limit, for help texts."""
        return ", ".join(f"{f.name}={f.default}" for f in dataclasses.fields(cls))


class Budget:
    """A token bucket: `burst` tokens, refilled at `rate` a second and by `earn()`."""

    __slots__ = ("_burst", "_rate", "_stamp", "_tokens")

    def __init__(self, burst: float, rate: float) -> None:
        self._burst = float(burst)
        self._rate = float(rate)
        self._tokens = float(burst)
        self._stamp = time.monotonic()

    def take(self, amount: float = 1.0) -> bool:
        """Spend `amount` tokens; False (and nothing spent) when there are not enough."""
        now = time.monotonic()
        tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate)
        self._stamp = now
        if tokens < amount:
            self._tokens = tokens
            return False
        self._tokens = tokens - amount
        return True

    def earn(self, amount: float) -> None:
        self._tokens = min(self._burst, self._tokens + amount)
