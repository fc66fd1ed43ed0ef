"""Checks the scaling knobs share."""


from __future__ import annotations

from typing import Any


def require_non_negative(owner: Any, names: tuple[str, ...], context: str = "") -> None:
    """Raise ValueError unless each named attribute of `owner` is >= 0 (NaN included)."""
    for name in names:
        value = getattr(owner, name)
        # `not >=` also rejects NaN, which would make every comparison false.
        if not value >= 0:
            raise ValueError(f"{context}{name} must be >= 0, got {value!r}")
