"""The ``queue`` scorer: fewest requests: this gateway's in-flight count now, plus what the engine
last reported running and waiting beyond this gateway's own count at that moment (other
gateways' requests); min-max normalised.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from wakegate.extproc.scheduling import Request, Signals


def score(candidates: list[str], request: Request, signals: Signals) -> list[float]:
    engines = signals.engines
    inflight = signals.inflight
    depth = []
    for ep in candidates:
        state = engines.get(ep)
        mine = float(inflight(ep))
        if state is not None and (state.waiting is not None or state.running is not None):
            others = (state.waiting or 0.0) + (state.running or 0.0) - state.own
            depth.append(mine + others if others > 0 else mine)
        else:
            depth.append(mine)
    lo, hi = min(depth), max(depth)
    if hi - lo <= 0:
        return [1.0] * len(candidates)
    return [(hi - d) / (hi - lo) for d in depth]
