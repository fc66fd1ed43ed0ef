"""The ``session`` scorer: the session's endpoint: 1 for the endpoint the session key's consistent-
hash ring names (prepared by the picker in ``Request.session_owner``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from wakegate.extproc.scheduling import Request, Signals


def score(candidates: list[str], request: Request, signals: Signals) -> list[float]:
    owner = request.session_owner
    return [1.0 if ep == owner else 0.0 for ep in candidates]
