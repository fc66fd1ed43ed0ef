"""The scorers of scored picking, one module each, registered here by name (*pure*).

A scorer gives each candidate endpoint of one request a score in [0, 1], higher is better;
:func:`wakegate.extproc.scheduling.schedule` adds them up with the route's weights and picks the
best. It reads only what the request and the load signals say
(:class:`~wakegate.extproc.scheduling.Request`: the request's headers and body, and what the
picker prepared for the built-in scorers; :class:`~wakegate.extproc.scheduling.Signals`: in-flight
counts and engine state), so a new one needs no change anywhere else in extproc: write a module
with a function ``score(candidates, request, signals) -> list[float]`` and add one
:func:`register` line below (docs/architecture.md, "Writing a scorer"). A route names it in its
weights by the registered name; a Model names it in ``routing.weights`` once the Model schema has
a weight for it (control/schema.py, ``Weights``; the built-in names are ``contract.SCORERS``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from wakegate import contract
from wakegate.extproc.scorers import kv_cache, precise, prefix, queue, session

if TYPE_CHECKING:
    from wakegate.extproc.scheduling import Request, Signals

Scorer = Callable[[list[str], "Request", "Signals"], list[float]]

SCORERS: dict[str, Scorer] = {}
"""Scorer name -> scorer; the names are the keys of a route's (and a Model's) weights."""


def register(name: str, scorer: Scorer) -> None:
    """Make `scorer` pickable by `name` (a name is registered once)."""
    if name in SCORERS:
        raise ValueError(f"a scorer named {name!r} is registered already")
    SCORERS[name] = scorer


register("queue", queue.score)
register("kv-cache", kv_cache.score)
register("prefix", prefix.score)
register("precise", precise.score)
register("session", session.score)

if set(SCORERS) != set(contract.SCORERS):  # pragma: no cover - caught by any import in the tests
    raise ImportError("contract.SCORERS and extproc's scorers disagree")
