"""The scorers of scored picking, one module each, registered by name (*pure*).

A scorer gives each candidate endpoint of one request a score in [0, 1], higher is better;
:func:`wakegate.extproc.scheduling.schedule` adds them up with the route's weights and picks the
best. It reads only what the request and the load signals say
(:class:`~wakegate.extproc.scheduling.Request`: the request's headers and body, and what the
picker prepared for the built-in scorers; :class:`~wakegate.extproc.scheduling.Signals`: in-flight
counts and engine state), so a new one needs no change anywhere else in extproc: write a module
with a function ``score(candidates, request, signals) -> list[float]`` and add one
:class:`~wakegate.contract.ScorerSpec` line to ``contract.SCORERS``, which this registry is built
from and the Model schema's ``routing.weights`` too (docs/architecture.md, "Writing a scorer").
:func:`register` adds one more by hand, for routes only.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, cast

from wakegate import contract

if TYPE_CHECKING:
    from wakegate.extproc.scheduling import Request, Signals

Scorer = Callable[[list[str], "Request", "Signals"], list[float]]


def registry(table: Iterable[contract.ScorerSpec]) -> dict[str, Scorer]:
    """Scorer name -> the ``score`` function of its spec's module, for each spec of `table`."""
    found: dict[str, Scorer] = {}
    for spec in table:
        if spec.name in found:
            raise ValueError(f"a scorer named {spec.name!r} is in the table twice")
        found[spec.name] = cast(Scorer, importlib.import_module(spec.module).score)
    return found


SCORERS: dict[str, Scorer] = registry(contract.SCORERS)
"""Scorer name -> scorer; the names are the keys of a route's (and a Model's) weights."""


def register(name: str, scorer: Scorer) -> None:
    """Make `scorer` pickable by `name` in :data:`SCORERS` (a name is registered once)."""
    if name in SCORERS:
        raise ValueError(f"a scorer named {name!r} is registered already")
    SCORERS[name] = scorer
