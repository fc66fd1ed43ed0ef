"""What idling saved: per model, accelerator-seconds spent in each tier, and the wakes it cost.

Pure bookkeeping, fed with wall-clock times by whoever applies the tiers (`wakegate up`):

* ``observe(model, tier, units, now)`` whenever a model's tier or its count of units changes. A
  unit is one accelerator of one replica (a replica without an accelerator counts as one, so a
  CPU model reports replica-seconds). Warm counts the replicas that hold their accelerators,
  asleep the sleeping ones, zero one replica's worth: what the model would hold if it were warm.
* ``wake(model, tier, seconds, now)`` for every wake, from asleep or from zero: how long the
  demand that woke it waited.

``totals(now)`` are the counters `/metrics` exports (``wakegate_accelerator_seconds_total``);
``window(since, until)`` is what `wakegate savings` shows for a time window: the same integral,
cut at the window's ends. Warm is held; asleep and zero are released. Each model keeps its last
``EVENTS`` transitions and wakes: a window older than that starts at the oldest one kept.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

TIERS = ("warm", "asleep", "zero")
WAKE_TIERS = ("asleep", "zero")
EVENTS = 4096


@dataclass
class _Book:
    tier: str
    units: int
    since: float
    #: accelerator-seconds per tier up to `since`
    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TIERS, 0.0))
    #: (at, tier, units) from each change on, oldest first
    events: deque[tuple[float, str, int]] = field(default_factory=lambda: deque(maxlen=EVENTS))
    #: (at, tier, seconds waited)
    wakes: deque[tuple[float, str, float]] = field(default_factory=lambda: deque(maxlen=EVENTS))
    wake_totals: dict[str, list[float]] = field(default_factory=lambda: {t: [0, 0.0] for t in WAKE_TIERS})


class Ledger:
    def __init__(self) -> None:
        self._books: dict[str, _Book] = {}

    def observe(self, model: str, tier: str, units: int, now: float) -> None:
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}")
        book = self._books.get(model)
        if book is None:
            book = self._books[model] = _Book(tier, units, now)
            book.events.append((now, tier, units))
            return
        if (book.tier, book.units) == (tier, units):
            return
        book.totals[book.tier] += max(0.0, now - book.since) * book.units
        book.tier, book.units, book.since = tier, units, now
        book.events.append((now, tier, units))

    def wake(self, model: str, tier: str, seconds: float, now: float) -> None:
        book = self._books.get(model)
        if book is None or tier not in WAKE_TIERS:
            return
        book.wakes.append((now, tier, seconds))
        count_sum = book.wake_totals[tier]
        count_sum[0] += 1
        count_sum[1] += seconds

    def tier(self, model: str) -> str | None:
        book = self._books.get(model)
        return book.tier if book is not None else None

    def totals(self, now: float) -> dict[str, dict[str, float]]:
        """model -> tier -> accelerator-seconds since the model was first observed."""
        out = {}
        for model, book in self._books.items():
            totals = dict(book.totals)
            totals[book.tier] += max(0.0, now - book.since) * book.units
            out[model] = totals
        return out

    def window(self, since: float, until: float) -> dict[str, dict[str, Any]]:
        """model -> accelerator-seconds per tier, held and released, and wakes by tier, in [since, until]."""
        return {model: self._window(book, since, until) for model, book in self._books.items()}

    def window_of(self, model: str, since: float, until: float) -> dict[str, Any] | None:
        """One model's `window` (None: never observed)."""
        book = self._books.get(model)
        return None if book is None else self._window(book, since, until)

    @staticmethod
    def _window(book: _Book, since: float, until: float) -> dict[str, Any]:
        seconds = dict.fromkeys(TIERS, 0.0)
        events = list(book.events)
        for i, (at, tier, units) in enumerate(events):
            end = events[i + 1][0] if i + 1 < len(events) else until
            start, stop = max(at, since), min(end, until)
            if stop > start:
                seconds[tier] += (stop - start) * units
        wakes = {t: {"count": 0, "wait_seconds": 0.0} for t in WAKE_TIERS}
        for at, tier, waited in book.wakes:
            if since <= at <= until:
                wakes[tier]["count"] += 1
                wakes[tier]["wait_seconds"] += waited
        held = seconds["warm"]
        released = seconds["asleep"] + seconds["zero"]
        return {
            "accelerator_seconds": seconds,
            "held": held,
            "released": released,
            "released_share": released / (held + released) if held + released > 0 else 0.0,
            "wakes": wakes,
        }
