"""Envoy's per-model upstream counters, and the share of them only Envoy saw (the native path).

A request Envoy routes alone (`routing.path: native`) never reaches extproc, so no demand report
counts it. Whoever sits beside an Envoy polls its admin API for each model cluster's
`upstream_rq_active` and `upstream_rq_total` and counts what exceeds the requests extproc routed
itself: `wakegate up`'s supervisor (one more member of its demand book, control/up/native.py)
and, on a cluster, the extproc in the gateway pod (added to its own reports,
extproc/native.py). Both halves use this one module, so the two agree. Pure: the polling is
the caller's.

A request that began and ended between two polls leaves no active count, only a moved total:
it counts as one request in flight for that interval, so a model busy with short requests
never looks idle. Idle detection has the resolution of the poll interval.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from urllib.parse import quote

#: Seconds between polls: idle detection is this much late at most.
POLL_SECONDS = 0.25
#: The admin API query both pollers send: the two counters of every model cluster, nothing else.
#: `usedonly` skips stats never written (a model no request reached yet, which counts as zero):
#: Envoy then tests fewer names against the regex (200 model clusters that all served: ~5 ms of
#: its CPU per poll instead of ~14 ms; docs/performance.md, "The native path on a cluster").
STATS_QUERY = "/stats?format=json&usedonly&filter=" + quote(r"^cluster\.model_[^.]+\.upstream_rq_(active|total)$")


def stat_name(model_key: str) -> str:
    """The model cluster's name in Envoy's stats (`cluster.<this>.upstream_rq_total`)."""
    # Envoy splits stat names at dots; a dot-free name keeps per-model stats one label value.
    return "model_" + model_key.replace("/", "_").replace(".", "_").replace("-", "_")


def parse_counters(stats: Iterable[Mapping[str, object]], stat_names: Mapping[str, str]) -> dict[str, tuple[int, int]]:
    """Envoy's `/stats?format=json` entries -> model key -> (upstream_rq_active, upstream_rq_total).

    `stat_names`: the model cluster's stat name -> model key. Unknown names are skipped.
    """
    found: dict[str, list[int]] = {}
    for entry in stats:
        name = str(entry.get("name", ""))
        parts = name.split(".")
        if len(parts) != 3 or parts[0] != "cluster" or parts[1] not in stat_names:
            continue
        value = entry.get("value", 0)
        count = int(value) if isinstance(value, int | float | str) else 0
        pair = found.setdefault(stat_names[parts[1]], [0, 0])
        if parts[2] == "upstream_rq_active":
            pair[0] = count
        elif parts[2] == "upstream_rq_total":
            pair[1] = count
    return {key: (active, total) for key, (active, total) in found.items()}


class NativeInFlight:
    """Requests in flight on the native path per model, from successive polls of one Envoy."""

    def __init__(self) -> None:
        self._totals: dict[str, int] = {}

    def update(
        self, counters: Mapping[str, tuple[int, int]], native: Iterable[str], decided: Mapping[str, int]
    ) -> dict[str, int]:
        """Model key -> native requests in flight, for every key in `native`, after one poll.

        `counters`: model key -> (active, total) upstream requests in Envoy (parse_counters).
        `decided`: extproc's own in-flight requests of the same models, which Envoy's counts
        include too: only what exceeds them is native.
        """
        keys = sorted(set(native))
        # A model Envoy lists no counters for has had no request (or no cluster) yet: zero.
        totals = dict.fromkeys(keys, 0) | {key: total for key, (_, total) in counters.items()}
        out: dict[str, int] = {}
        for key in keys:
            active, total = counters.get(key, (0, 0))
            before = self._totals.get(key)
            in_flight = max(0, active - decided.get(key, 0))
            if in_flight == 0 and before is not None and total > before:
                in_flight = 1  # came and went between two polls
            out[key] = in_flight
        self._totals = totals
        return out
