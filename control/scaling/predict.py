"""Predictive wake: when a model's next demand will come, from its own history, and why.

Pure. A model's history is the wall-clock times its demand began (an *onset*: the first request
after a time without any). Two predictors look at it:

* **periodic**: demand that came at about the same time of day on several of the last days (or
  the same time of week on several of the last weeks) is expected again. For a candidate time t
  ahead, each of the last ``CYCLES`` periods P (a day: ``periodSeconds``; a week: 7 of them) is
  asked whether an onset fell within ``tolerance`` of t - k·P; two or more such periods, and at
  least half of those the history covers, predict t.
* **inter-arrival**: when the last ``GAPS`` gaps between onsets are regular (their spread at most
  half their median), the next onset is expected one median gap after the last.

`predict` returns the earliest prediction ahead of ``now`` (within a lookahead), with a sentence
that says why, for `/status`. `Speculation` keeps the budget: accelerator-seconds spent warm on
predictions over the last period, and the outcome of each speculative wake (hit: demand came
while it was warm for it; miss: it went back without any).
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: Onsets kept per model (the oldest go first): four weeks of 18 a day.
KEEP = 512
#: Periods looked back on, and gaps averaged.
CYCLES = 4
GAPS = 4


@dataclass(frozen=True, slots=True)
class Policy:
    """`spec.scaling.predictive` of one model, in seconds."""

    lead: float
    budget: float
    period: float

    @property
    def tolerance(self) -> float:
        """How far from a past onset a candidate may be and still count as "the same time":
        a 96th of the period (15 minutes of a day), at least the lead."""
        return max(self.period / 96, self.lead)


@dataclass(frozen=True, slots=True)
class Prediction:
    at: float
    why: str
    source: str


def _clock(at: float, period: float) -> str:
    phase = at % period
    if period == 86400:
        return time.strftime("%H:%M UTC", time.gmtime(at))
    return f"{phase:.0f}s into the {period:.0f}s period"


def _support(onsets: list[float], t: float, period: float, tolerance: float) -> tuple[int, int]:
    """(past periods with an onset near t - k·period, past periods the history covers) for k = 1..CYCLES."""
    hits = covered = 0
    first = onsets[0] if onsets else t
    for k in range(1, CYCLES + 1):
        then = t - k * period
        if then < first - tolerance:
            break
        covered += 1
        if any(abs(o - then) <= tolerance for o in onsets):
            hits += 1
    return hits, covered


def periodic(onsets: list[float], now: float, policy: Policy, lookahead: float) -> Prediction | None:
    tolerance = policy.tolerance
    best: Prediction | None = None
    # A time the latest onset already came near was served: it is not predicted again.
    served = onsets[-1] + tolerance if onsets else -math.inf
    for period, name in ((policy.period, "daily"), (policy.period * 7, "weekly")):
        recent = [o for o in onsets if o >= now - CYCLES * period - tolerance]
        candidates = sorted(
            {
                o + k * period
                for o in recent
                for k in range(1, CYCLES + 1)
                if max(now, served) < o + k * period <= now + lookahead
            }
        )
        for t in candidates:
            hits, covered = _support(recent, t, period, tolerance)
            if hits >= 2 and 2 * hits >= covered:
                unit = "days" if name == "daily" else "weeks"
                why = (f"{name}: demand began within {tolerance:.0f}s of {_clock(t, policy.period)} on {hits} of "
                       f"the last {covered} {unit}")
                if best is None or t < best.at:
                    best = Prediction(t, why, name)
                break
    return best


def interarrival(onsets: list[float], now: float, policy: Policy, lookahead: float) -> Prediction | None:
    if len(onsets) < GAPS + 1:
        return None
    last = onsets[-GAPS - 1 :]
    gaps = [b - a for a, b in itertools.pairwise(last)]
    median = statistics.median(gaps)
    if median <= 0 or (max(gaps) - min(gaps)) > median / 2:
        return None
    at = onsets[-1] + median
    if not now < at <= now + lookahead:
        return None
    why = (f"inter-arrival: the last {GAPS} gaps were {min(gaps):.0f}-{max(gaps):.0f}s, next expected "
           f"{median:.0f}s after the last")
    return Prediction(at, why, "interarrival")


def predict(onsets: list[float], now: float, policy: Policy) -> Prediction | None:
    """The earliest predicted onset after `now` (looking a lead and a tolerance ahead), or None."""
    lookahead = policy.lead + policy.tolerance
    found = [p for p in (periodic(onsets, now, policy, lookahead), interarrival(onsets, now, policy, lookahead)) if p]
    return min(found, key=lambda p: p.at, default=None)


class History:
    """Onsets per model, bounded, saved as JSON (`wakegate up`: its state directory)."""

    def __init__(self, onsets: Mapping[str, Iterable[float]] | None = None) -> None:
        self.onsets: dict[str, deque[float]] = {k: deque(v, maxlen=KEEP) for k, v in (onsets or {}).items()}
        #: onsets added since the start, per model (tells a cached prediction it is stale)
        self.added: dict[str, int] = {}

    def add(self, model: str, at: float) -> None:
        self.onsets.setdefault(model, deque(maxlen=KEEP)).append(at)
        self.added[model] = self.added.get(model, 0) + 1

    def of(self, model: str) -> list[float]:
        return list(self.onsets.get(model, ()))

    def to_json(self) -> str:
        return json.dumps({"version": 1, "onsets": {k: list(v) for k, v in self.onsets.items()}})

    @classmethod
    def from_json(cls, text: str) -> History:
        """A history from `to_json`'s text; ValueError when it is not one."""
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("version") != 1 or not isinstance(data.get("onsets"), dict):
            raise ValueError("not a demand history (version 1)")
        onsets: dict[str, list[float]] = {}
        for model, values in data["onsets"].items():
            if not isinstance(model, str) or not isinstance(values, list):
                raise ValueError("not a demand history: onsets must map model names to lists of times")
            onsets[model] = sorted(float(v) for v in values)
        return cls(onsets)


@dataclass
class Episode:
    """One speculative wake: when, for which prediction, and what came of it."""

    woke_at: float
    prediction: Prediction
    #: accelerator-seconds spent warm for it so far (while it waited for the demand)
    spent: float = 0.0
    outcome: str = "pending"  # pending, hit, miss


@dataclass
class Speculation:
    """A model's speculative wakes: the open one, outcomes, and the budget over the last period."""

    policy: Policy
    episodes: deque[Episode] = field(default_factory=lambda: deque(maxlen=256))
    hits: int = 0
    #: demand came for it before the wake was done (the first request still waited, less)
    late: int = 0
    misses: int = 0
    wasted: float = 0.0
    #: accelerator-seconds of every settled wake (hits and late ones included)
    spent_total: float = 0.0

    @property
    def open(self) -> Episode | None:
        last = self.episodes[-1] if self.episodes else None
        return last if last is not None and last.outcome == "pending" else None

    def spent(self, now: float) -> float:
        """Accelerator-seconds spent on speculation by wakes of the last period."""
        return sum(e.spent for e in self.episodes if e.woke_at >= now - self.policy.period)

    def affordable(self, now: float) -> bool:
        return self.spent(now) < self.policy.budget

    def woke(self, prediction: Prediction, now: float) -> Episode:
        episode = Episode(now, prediction)
        self.episodes.append(episode)
        return episode

    def settle(self, outcome: str) -> Episode | None:
        """The open episode's outcome: demand found the model warm (hit), came while it was still
        waking (late), or never came (miss: what it spent is wasted)."""
        episode = self.open
        if episode is None:
            return None
        episode.outcome = outcome
        self.spent_total += episode.spent
        if outcome == "hit":
            self.hits += 1
        elif outcome == "late":
            self.late += 1
        else:
            self.misses += 1
            self.wasted += episode.spent
        return episode

    def status(self, now: float) -> dict[str, Any]:
        last = self.episodes[-1] if self.episodes else None
        return {
            "hits": self.hits,
            "late": self.late,
            "misses": self.misses,
            "wasted_seconds": round(self.wasted, 3),
            "spent_seconds_this_period": round(self.spent(now), 3),
            "spent_seconds_total": round(self.spent_total + (self.open.spent if self.open else 0.0), 3),
            "budget_seconds": self.policy.budget,
            "last_wake": None if last is None else {
                "at": last.woke_at, "predicted_at": last.prediction.at, "why": last.prediction.why,
                "outcome": last.outcome, "spent_seconds": round(last.spent, 3),
            },
        }
