"""The share of a prompt's leading blocks each endpoint holds: what the ``prefix`` and ``precise``
scorers score, over the blocks each counts."""

from __future__ import annotations

from collections.abc import Mapping


def leading_share(candidates: list[str], total: int, matches: Mapping[str, int]) -> list[float]:
    """`matches` (endpoint -> leading blocks it holds) over `total` blocks; all 0 with no blocks."""
    if not total:
        return [0.0] * len(candidates)
    return [matches.get(ep, 0) / total for ep in candidates]
