"""The ``kv-cache`` scorer: most free KV cache: 1 - the engine's KV-cache usage; 0.5 while unknown."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from wakegate.extproc.scheduling import Request, Signals


def score(candidates: list[str], request: Request, signals: Signals) -> list[float]:
    engines = signals.engines
    out = []
    for ep in candidates:
        state = engines.get(ep)
        usage = state.kv_usage if state is not None else None
        out.append(0.5 if usage is None else 1.0 - min(1.0, max(0.0, usage)))
    return out
