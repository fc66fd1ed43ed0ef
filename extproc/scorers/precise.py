"""The ``precise`` scorer: longest prompt prefix the engine holds: the share of the prompt's
leading KV blocks its engine says it holds, from its KV events
(:class:`~wakegate.extproc.kvindex.KVIndex`, prepared by the picker in
``Request.block_matches``); 0 for an endpoint the index knows nothing of.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wakegate.extproc.scorers.matched import leading_share

if TYPE_CHECKING:
    from wakegate.extproc.scheduling import Request, Signals


def score(candidates: list[str], request: Request, signals: Signals) -> list[float]:
    return leading_share(candidates, len(request.blocks), request.block_matches)
