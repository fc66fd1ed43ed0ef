"""Pure scaling decisions shared by every runtime (`wakegate up` today, Kubernetes later).

Modules here take plain values and return plain values: no I/O, no asyncio, no
clock reads. Time is always a parameter (``now``: monotonic float seconds), and
each decision also says when it could next change on its own
(``next_check_at``), so a runtime sleeps until then instead of polling.

* :mod:`wakegate.control.scaling.arbitration` owns GPU groups: which member of a
  ``spec.gpu.shared`` group holds the accelerator, and when it is swapped.
* :mod:`wakegate.control.scaling.autoscale` owns the replica count of one model.
"""

from __future__ import annotations

from typing import Any


def require_non_negative(owner: Any, names: tuple[str, ...], context: str = "") -> None:
    """Raise ValueError unless each named attribute of `owner` is >= 0 (NaN included)."""
    for name in names:
        value = getattr(owner, name)
        # `not >=` also rejects NaN, which would make every comparison false.
        if not value >= 0:
            raise ValueError(f"{context}{name} must be >= 0, got {value!r}")
