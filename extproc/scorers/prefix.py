"""The ``prefix`` scorer: longest prompt prefix recently sent: the share of the prompt's leading
blocks the endpoint was sent (:class:`~wakegate.extproc.prefix.PrefixIndex`, prepared by the
picker in ``Request.prefix_matches``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wakegate.extproc.scorers.matched import leading_share

if TYPE_CHECKING:
    from wakegate.extproc.scheduling import Request, Signals


def score(candidates: list[str], request: Request, signals: Signals) -> list[float]:
    return leading_share(candidates, len(request.chain), request.prefix_matches)
