"""An example scorer (docs/architecture.md, "Writing a scorer"): the endpoint a client names in
`x-preferred-endpoint` scores 1, every other 0."""

from __future__ import annotations

from wakegate.extproc.scheduling import Request, Signals


def score(candidates: list[str], request: Request, signals: Signals) -> list[float]:
    wanted = request.headers.get("x-preferred-endpoint")
    return [1.0 if endpoint == wanted else 0.0 for endpoint in candidates]
