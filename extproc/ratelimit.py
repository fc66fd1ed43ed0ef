"""Request rate limiting: owns the token buckets (one global, one per model) and Retry-After.

A request is admitted only if both the model's bucket and the global bucket have a token; then
one token is taken from each. If either refuses, nothing is taken from either, and the answer is
the number of seconds until both would admit (the HTTP ``Retry-After``, see
:func:`retry_after_header`).

Buckets start full (``burst`` tokens) and refill continuously at ``rate`` tokens per second up to
``burst``. A rate of ``None`` or ``0`` means unlimited (no bucket); a burst of ``None`` means
``max(1, rate)``. Per-model buckets are created lazily and replaced (starting full) when the
model's ``(rate, burst)`` changes. Their number is bounded: a bucket idle long enough to be full
again is indistinguishable from a new one and is dropped when new buckets are made, and beyond
:data:`MAX_MODEL_BUCKETS` the least recently used bucket is dropped.

Time comes from an injected ``clock`` (``time.monotonic`` by default). Single-threaded asyncio
use; no locks, no I/O.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["MAX_MODEL_BUCKETS", "RateLimiter", "TokenBucket", "retry_after_header"]

MAX_MODEL_BUCKETS = 10_000
"""Upper bound on the number of per-model buckets kept by one :class:`RateLimiter`."""


class TokenBucket:
    """``burst`` tokens at most, refilled at ``rate`` tokens per second; starts full."""

    __slots__ = ("_clock", "_last", "_tokens", "burst", "rate")

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"rate must be a finite number > 0, got {rate!r}")
        if not (math.isfinite(burst) and burst >= 1):
            raise ValueError(f"burst must be a finite number >= 1, got {burst!r}")
        self.rate = float(rate)
        self.burst = float(burst)
        self._clock = clock
        self._tokens = self.burst
        self._last = clock()

    def take(self) -> float:
        """Take a token: 0.0 if taken, else the seconds until one is available (> 0), taking nothing."""
        return self._take(self._clock())

    def peek(self) -> float:
        """What :meth:`take` would answer now, without taking."""
        return self._wait(self._clock())

    def _refill(self, now: float) -> None:
        if now > self._last:
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
        # A clock that went backwards refills nothing, and `_last` keeps the later time so the
        # same interval is never credited twice.

    def _wait(self, now: float) -> float:
        self._refill(now)
        if self._tokens >= 1.0:
            return 0.0
        return (1.0 - self._tokens) / self.rate

    def _take(self, now: float) -> float:
        wait = self._wait(now)
        if wait == 0.0:
            self._tokens -= 1.0
        return wait

    def _full_at(self, now: float) -> bool:
        """True when, at ``now``, the bucket would be full (so it equals a fresh bucket)."""
        return self._tokens + max(0.0, now - self._last) * self.rate >= self.burst


def _normalize(rate: float | None, burst: float | None) -> tuple[float, float] | None:
    """``(rate, burst)`` of a bucket, or None for unlimited. Raises ValueError on nonsense."""
    if rate is None or rate == 0:
        return None
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be None, 0 or a finite number > 0, got {rate!r}")
    if burst is None:
        burst = max(1.0, rate)
    if not (math.isfinite(burst) and burst >= 1):
        raise ValueError(f"burst must be None or a finite number >= 1, got {burst!r}")
    return float(rate), float(burst)


class RateLimiter:
    """A global bucket plus lazily created per-model buckets."""

    def __init__(
        self,
        global_rate: float | None,
        global_burst: float | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        g = _normalize(global_rate, global_burst)
        self._global: TokenBucket | None = None if g is None else TokenBucket(g[0], g[1], clock)
        # model_key -> bucket; order = least recently used first.
        self._models: OrderedDict[str, TokenBucket] = OrderedDict()

    @property
    def model_bucket_count(self) -> int:
        """How many per-model buckets are currently kept."""
        return len(self._models)

    def admit(
        self,
        model_key: str,
        model_rate: float | None,
        model_burst: float | None,
        *,
        counted_elsewhere: bool = False,
        global_counted_elsewhere: bool = False,
    ) -> float:
        """0.0 = admitted (a token taken from each applicable bucket); else Retry-After seconds (> 0).

        ``model_rate`` None or 0 means the model is unlimited (only the global bucket applies).
        ``counted_elsewhere``: the model's token was taken already (by Envoy's bucket for the
        model): only the global bucket applies, and the model's own bucket here is kept as it is.
        Raises ValueError for a negative/non-finite rate or a burst below 1 (config validation
        should have caught those). ``global_counted_elsewhere``: the gateway-wide token was taken
        already too (Envoy keeps that bucket as well): the global bucket here is left as it is.
        """
        now = self._clock()
        model = None if counted_elsewhere else self._model_bucket(model_key, model_rate, model_burst, now)
        glob = None if global_counted_elsewhere else self._global
        wait = 0.0
        if model is not None:
            wait = model._wait(now)
        if glob is not None:
            wait = max(wait, glob._wait(now))
        if wait > 0.0:
            return wait
        if model is not None:
            model._take(now)
        if glob is not None:
            glob._take(now)
        return 0.0

    def _model_bucket(self, model_key: str, rate: float | None, burst: float | None, now: float) -> TokenBucket | None:
        params = _normalize(rate, burst)
        models = self._models
        bucket = models.get(model_key)
        if params is None:
            if bucket is not None:
                del models[model_key]
            return None
        if bucket is not None and (bucket.rate, bucket.burst) == params:
            models.move_to_end(model_key)
            return bucket
        if bucket is None:
            self._prune(now)
        else:
            del models[model_key]
        bucket = TokenBucket(params[0], params[1], self._clock)
        bucket._last = now
        models[model_key] = bucket
        return bucket

    def _prune(self, now: float) -> None:
        """Make room for one new bucket: drop idle (full) buckets, then the LRU one if at the cap."""
        models = self._models
        # Amortised O(1): each bucket is dropped at most once, and we stop at the first busy one.
        while models:
            key, oldest = next(iter(models.items()))
            if not oldest._full_at(now):
                break
            del models[key]
        while len(models) >= MAX_MODEL_BUCKETS:
            models.popitem(last=False)


def retry_after_header(seconds: float) -> str:
    """The HTTP ``Retry-After`` value for a wait of ``seconds``: whole seconds, rounded up, at least 1."""
    if not math.isfinite(seconds) or seconds <= 1.0:
        return "1"
    return str(math.ceil(seconds))
