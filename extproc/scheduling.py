"""Scored endpoint picking: filters, then weighted scorers, then a picker (*pure*).

One decision (:func:`schedule`) over a model's ready endpoints:

1. **Filters** narrow the candidates: :func:`adapter_present` (an endpoint known not to serve
   the requested LoRA adapter is out), :func:`adapter_room` (when none holds it, an endpoint
   known to hold its ``max_adapters`` others is out: loading there would evict one),
   :func:`under_capacity` (an endpoint whose engine reports
   :data:`QUEUE_LIMIT` or more waiting requests, or whose gateway-side in-flight count reached its
   known concurrency, is out; a shorter queue is the queue scorer's business, because leaving a
   replica that holds the prompt's prefix for one that must prefill it costs more than a short
   wait, and every such spill copies the prefix into one more cache). A
   filter that would leave no candidate is skipped: when every endpoint is full the request still
   goes to the best of them and waits in its queue, which is what a full fleet does anyway.
   Readiness and draining are settled before picking: the route holds ready endpoints only, and
   an endpoint that drains leaves it.
2. **Scorers** (:mod:`wakegate.extproc.scorers`, one module each, registered by name) give each
   remaining candidate a score in [0, 1]; higher is better:
   ``queue`` (fewest requests: this gateway's in-flight count now, plus what the engine last
   reported running and waiting beyond this gateway's own count at that moment, i.e. other
   gateways' requests; min-max normalised), ``kv-cache`` (1 - the engine's KV-cache usage; 0.5 while unknown),
   ``prefix`` (the share of the prompt's leading blocks the endpoint was recently sent, from
   :class:`~wakegate.extproc.prefix.PrefixIndex`), ``precise`` (the share of the prompt's leading
   KV blocks the endpoint's engine says it holds, from its KV events via
   :class:`~wakegate.extproc.kvindex.KVIndex`; 0 for an endpoint the index knows nothing of),
   ``session`` (1 for the endpoint the session key's consistent-hash ring names).
3. The **picker** takes the highest weighted sum; ties (within 1e-9) rotate, so equal endpoints
   share traffic.

Every step is O(candidates), except ``prefix`` and ``precise``, which walk the prompt's block
chain once (bounded by :data:`~wakegate.extproc.prefix.MAX_BLOCKS` and
:data:`~wakegate.kvevents.MAX_BLOCKS`). Scorers only read :class:`Signals`;
where its numbers come from (the ext_proc stream's end, an access log, a metrics scrape) is
the caller's business.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from wakegate import contract
from wakegate.extproc.scorers import SCORERS, Scorer

__all__ = [
    "FILTERS",
    "Decision",
    "EngineState",
    "Request",
    "Signals",
    "adapter_present",
    "adapter_room",
    "schedule",
    "under_capacity",
    "weights_for",
]

_TIE = 1e-9

QUEUE_LIMIT = contract.QUEUE_LIMIT
"""Waiting requests at which the capacity filter takes an endpoint out of the candidates."""


@dataclass(slots=True)
class EngineState:
    """What an endpoint's engine last said about itself (fields None until known)."""

    waiting: float | None = None
    running: float | None = None
    own: float = 0.0
    """This gateway's in-flight count for the endpoint when the numbers above were read."""
    kv_usage: float | None = None
    max_running: int | None = None
    adapters: frozenset[str] | None = None
    """LoRA adapters the engine holds (None: unknown)."""
    max_adapters: int | None = None
    """How many it holds at most (vLLM's ``max_lora``; None: unknown)."""


@dataclass(slots=True)
class Signals:
    """The load signals scorers read: in-flight counts, and engine state where it is known."""

    inflight: Callable[[str], int]
    engines: Mapping[str, EngineState] = field(default_factory=dict)


@dataclass(slots=True)
class Request:
    """What the scorers need to know about one request."""

    chain: Sequence[int] = ()
    """The prompt's block-hash chain (:func:`~wakegate.extproc.prefix.chain`)."""
    prefix_matches: Mapping[str, int] = field(default_factory=dict)
    """Endpoint -> leading blocks of ``chain`` it holds (:meth:`PrefixIndex.matches`)."""
    blocks: Sequence[bytes | int] = ()
    """The prompt's KV block-hash chain as the engine names it (:func:`~wakegate.kvevents.body_blocks`)."""
    block_matches: Mapping[str, int] = field(default_factory=dict)
    """Endpoint -> leading blocks of ``blocks`` its engine holds (:meth:`KVIndex.matches`)."""
    session_owner: str | None = None
    """The endpoint the session key hashes to, or None when the request has no session."""
    adapter: str | None = None
    """The LoRA adapter asked for, or None."""
    headers: Mapping[str, str] = field(default_factory=dict)
    """The request's headers (lower-case names), for scorers that read them."""
    body: Mapping[str, Any] | None = None
    """The request's JSON body where Envoy sent it, for scorers that read it."""


@dataclass(slots=True)
class Decision:
    """The pick, and why (for tests and debug logs)."""

    endpoint: str | None
    candidates: list[str]
    scores: dict[str, float]


Filter = Callable[[list[str], Request, Signals], list[str]]


def adapter_present(candidates: list[str], request: Request, signals: Signals) -> list[str]:
    """Drop endpoints whose engine is known to lack the requested adapter."""
    if request.adapter is None:
        return candidates
    engines = signals.engines
    out = []
    for ep in candidates:
        state = engines.get(ep)
        if state is None or state.adapters is None or request.adapter in state.adapters:
            out.append(ep)
    return out


def adapter_room(candidates: list[str], request: Request, signals: Signals) -> list[str]:
    """When no candidate is known to hold the requested adapter: drop those known to be full of
    others, so that a load there evicts nothing (one with a free slot loads it)."""
    if request.adapter is None:
        return candidates
    engines = signals.engines
    out = []
    for ep in candidates:
        state = engines.get(ep)
        if state is not None and state.adapters is not None:
            if request.adapter in state.adapters:
                return candidates  # adapter_present kept the holders (and unknowns) already
            if state.max_adapters is not None and len(state.adapters) >= state.max_adapters:
                continue
        out.append(ep)
    return out


def under_capacity(candidates: list[str], request: Request, signals: Signals) -> list[str]:
    """Drop saturated endpoints: :data:`QUEUE_LIMIT` waiting at the engine, or in flight at the known limit."""
    engines = signals.engines
    inflight = signals.inflight
    out = []
    for ep in candidates:
        state = engines.get(ep)
        if state is not None:
            if state.waiting is not None and state.waiting >= QUEUE_LIMIT:
                continue
            if state.max_running is not None and inflight(ep) >= state.max_running:
                continue
        out.append(ep)
    return out












FILTERS: tuple[Filter, ...] = (adapter_present, adapter_room, under_capacity)
"""The filters, in the order they run."""


def weights_for(
    profile: str, weights: Mapping[str, float], scorers: Mapping[str, Scorer] = SCORERS
) -> dict[str, float]:
    """A Model's effective weights: explicit ``weights`` win (those naming one of ``scorers``),
    else the named profile's (unknown: {})."""
    if weights:
        return {name: float(w) for name, w in weights.items() if name in scorers and w > 0}
    return dict(contract.PROFILES.get(profile, {}))


class Rotation:
    """The tie-breaker's turn counter (one per picker)."""

    __slots__ = ("turn",)

    def __init__(self) -> None:
        self.turn = 0


def schedule(
    endpoints: Sequence[str],
    weights: Mapping[str, float],
    request: Request,
    signals: Signals,
    rotation: Rotation,
    scorers: Mapping[str, Scorer] = SCORERS,
) -> Decision:
    """Filter, score with ``scorers`` (by the names ``weights`` use) and pick one of ``endpoints``
    (None only when there are none)."""
    candidates = list(endpoints)
    if not candidates:
        return Decision(None, [], {})
    for keep in FILTERS:
        narrowed = keep(candidates, request, signals)
        if narrowed:
            candidates = narrowed
    totals = [0.0] * len(candidates)
    for name, weight in weights.items():
        scorer = scorers.get(name)
        if scorer is None or weight <= 0:
            continue
        for i, s in enumerate(scorer(candidates, request, signals)):
            totals[i] += weight * s
    best = max(totals)
    tied = [ep for ep, t in zip(candidates, totals, strict=True) if best - t <= _TIE]
    if len(tied) == 1:
        pick = tied[0]
    else:
        rotation.turn += 1
        pick = tied[rotation.turn % len(tied)]
    return Decision(pick, candidates, dict(zip(candidates, totals, strict=True)))
