"""Per-tenant token budgets: tokens per minute, counted from the engines' own usage reports.

A key with ``tokens-per-minute=N`` in the key file puts its tenant on a budget. Its requests are
admitted while the tenant used fewer than N tokens (prompt + completion) in the last 60 seconds;
past it they get 429 ``token_budget`` with a Retry-After of the seconds until enough of that use
is a minute old. A request already admitted is never cut: the budget is checked at admission, so
a tenant may overshoot by what its requests in flight use.

Counting: for a budgeted request extproc asks Envoy for the response body as it streams past
(``response_body_mode: STREAMED``, only for these requests; everyone else's responses never reach
extproc) and reads the engine's ``usage`` from its end: the JSON body's, or the last SSE event's
(OpenAI's ``stream_options.include_usage``). A stream without usage counts one token per event.
The total goes back to Envoy as dynamic metadata (``wakegate.usage``) on the last body chunk, so
the access-log entry of the request carries it to *every* extproc: both the active and the standby
keep the same book from the same entries (docs/decisions.md, "Flow control with two extprocs").

Bounds: one 60-slot ring of one-second counts per budgeted tenant (at most MAX_TENANTS); the
response tail kept per request is 16 KiB.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable

from wakegate.contract import USAGE_METADATA_NAMESPACE

WINDOW_SECONDS = 60
MAX_TENANTS = 10_000
USAGE_NAMESPACE = USAGE_METADATA_NAMESPACE
_TAIL = 16 * 1024
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


class TokenBudgets:
    """Tokens used per tenant over the last minute, in one-second slots."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        #: tenant -> [second, tokens] slots, oldest first, none older than the window
        self._used: dict[str, deque[list[int]]] = {}

    def add(self, tenant: str, tokens: int) -> None:
        if tokens <= 0:
            return
        slots = self._used.get(tenant)
        if slots is None:
            if len(self._used) >= MAX_TENANTS:
                self._used.pop(next(iter(self._used)))
            slots = self._used[tenant] = deque()
        second = int(self._clock())
        self._expire(slots, second)
        if slots and slots[-1][0] == second:
            slots[-1][1] += tokens
        else:
            slots.append([second, tokens])

    def used(self, tenant: str) -> int:
        slots = self._used.get(tenant)
        if slots is None:
            return 0
        self._expire(slots, int(self._clock()))
        return sum(tokens for _, tokens in slots)

    def retry_after(self, tenant: str, per_minute: int) -> float:
        """0 while the tenant is under its budget, else seconds until it is again."""
        used = self.used(tenant)
        if used < per_minute:
            return 0.0
        now = self._clock()
        for second, tokens in self._used[tenant]:
            used -= tokens
            if used < per_minute:
                return max(1.0, second + WINDOW_SECONDS - now)
        return float(WINDOW_SECONDS)

    @staticmethod
    def _expire(slots: deque[list[int]], second: int) -> None:
        while slots and slots[0][0] <= second - WINDOW_SECONDS:
            slots.popleft()


class Usage:
    """What one budgeted request's response says it used, read as the body streams past."""

    __slots__ = ("events", "tail", "tenant")

    def __init__(self, tenant: str) -> None:
        self.tenant = tenant
        self.tail = b""
        self.events = 0

    def feed(self, chunk: bytes) -> None:
        self.events += chunk.count(b"data: {")
        self.tail = (self.tail + chunk)[-_TAIL:]

    def tokens(self) -> int:
        """prompt + completion tokens of the last `usage` in the body; without one, one per SSE event."""
        at = self.tail.rfind(b'"usage"')
        if at >= 0:
            prompt = _PROMPT.search(self.tail, at)
            completion = _COMPLETION.search(self.tail, at)
            if prompt is not None or completion is not None:
                return sum(int(m.group(1)) for m in (prompt, completion) if m is not None)
        return self.events
