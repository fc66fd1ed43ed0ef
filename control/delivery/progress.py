"""Progress of a pull, a push or a staging: the events, their rate and ETA, and their text.

Pure: the caller passes the time. A delivery step reports `Progress` events to a sink (a
callable); the CLI prints them, `wakegate up` puts the latest in `/status`. Events come at
every phase change and at most every `Tracker.interval` seconds in between, so a sink may log
each one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum


class Phase(StrEnum):
    RESOLVING = "resolving"
    """Asking the registry or the Hub which digest a tag or branch names."""
    WAITING = "waiting"
    """Another process is pulling the same digest; its bytes are counted."""
    PULLING = "pulling"
    VERIFYING = "verifying"
    """Checking a cached entry's files against its block table."""
    CORRUPT = "corrupt"
    """A cached entry failed its check and is being fetched again (detail says which file)."""
    STAGING = "staging"
    PUSHING = "pushing"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True)
class Progress:
    phase: Phase
    source: str
    done: int = 0
    """Bytes moved (or checked) so far."""
    total: int | None = None
    rate: float | None = None
    """Bytes per second over the last few seconds."""
    eta: float | None = None
    """Seconds to go at that rate."""
    detail: str = ""

    def line(self) -> str:
        """One human line: `pulling oci://… 120.3 MB / 409.6 MB (29%) 85.2 MB/s ETA 3s`."""
        parts = [self.phase.value, self.source]
        if self.total:
            parts.append(f"{human_bytes(self.done)} / {human_bytes(self.total)} ({100 * self.done // self.total}%)")
        elif self.done:
            parts.append(human_bytes(self.done))
        if self.rate is not None:
            parts.append(f"{human_bytes(self.rate)}/s")
        if self.eta is not None:
            parts.append(f"ETA {human_seconds(self.eta)}")
        if self.detail:
            parts.append(f"({self.detail})" if self.phase not in (Phase.FAILED, Phase.CORRUPT) else self.detail)
        return " ".join(parts)


ProgressSink = Callable[[Progress], None]


def ignore(_: Progress) -> None:
    """The sink of a caller that does not watch."""


def human_bytes(count: float) -> str:
    value = float(count)
    for unit in ("B", "kB", "MB", "GB"):
        if abs(value) < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.2f} TB"


def human_seconds(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


class Meter:
    """Rate over a sliding window of (time, bytes) samples, and the ETA it gives."""

    def __init__(self, window: float = 3.0) -> None:
        self._window = window
        self._samples: deque[tuple[float, int]] = deque(maxlen=256)

    def update(self, now: float, done: int, total: int | None) -> tuple[float | None, float | None]:
        self._samples.append((now, done))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self._window:
            self._samples.popleft()
        first_time, first_done = self._samples[0]
        if now - first_time <= 0:
            return None, None
        rate = (done - first_done) / (now - first_time)
        eta = (total - done) / rate if total is not None and rate > 0 else None
        return rate, eta


class Tracker:
    """Counts bytes of one step and hands out `Progress` events at most every `interval` seconds
    (and always for the first and the last)."""

    def __init__(self, sink: ProgressSink, base: Progress, now: float, interval: float = 0.5) -> None:
        self._sink = sink
        self._current = base
        self._meter = Meter()
        self._interval = interval
        self._last = now
        self._meter.update(now, base.done, base.total)
        sink(base)

    @property
    def current(self) -> Progress:
        return self._current

    def advance(self, count: int, now: float) -> None:
        self.set_done(self._current.done + count, now)

    def set_done(self, done: int, now: float, force: bool = False) -> None:
        rate, eta = self._meter.update(now, done, self._current.total)
        self._current = replace(self._current, done=done, rate=rate, eta=eta)
        if force or now - self._last >= self._interval:
            self._last = now
            self._sink(self._current)

    def phase(self, phase: Phase, now: float, detail: str = "", total: int | None = None, done: int = 0) -> None:
        """A new phase (a new byte count); reported at once."""
        self._meter = Meter()
        self._meter.update(now, done, total)
        self._current = replace(self._current, phase=phase, detail=detail, total=total, done=done, rate=None, eta=None)
        self._last = now
        self._sink(self._current)

    def waiting(self, clock: Callable[[], float], total: int) -> Callable[[int], None]:
        """A callback for bytes another process has pulled so far, reported as `Phase.WAITING`."""

        def report(done: int) -> None:
            if self._current.phase is not Phase.WAITING:
                self.phase(Phase.WAITING, clock(), "another process is pulling it", total=total)
            self.set_done(done, clock())

        return report

    def finish(self, now: float, phase: Phase = Phase.READY, detail: str = "") -> Progress:
        """The closing event, with the step's average rate."""
        self.set_done(self._current.done, now)
        self._current = replace(self._current, phase=phase, detail=detail, eta=None)
        self._sink(self._current)
        return self._current
