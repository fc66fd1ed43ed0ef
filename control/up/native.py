"""Demand of the requests Envoy routes alone (the native path), from Envoy's own counters.

extproc never sees a natively routed request, so its demand reports miss them. `wakegate up`
polls its Envoy's per-cluster counters (`upstream_rq_active`, `upstream_rq_total`) and reports
what only Envoy saw as one more member of the same demand book, so idle timers, drains and
autoscaling count native requests exactly like decided ones. Pure: the polling is the caller's.

A request that began and ended between two polls leaves no active count, only a moved total:
it is reported as one request in flight for that interval, so a model busy with short requests
never looks idle. Idle detection has the resolution of the poll interval.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping

from wakegate.v1 import demand_pb2

#: Seconds between polls: idle detection is this much late at most.
POLL_SECONDS = 0.25


class NativeDemand:
    """Turns Envoy's per-cluster counters into DemandReports of the native requests."""

    def __init__(self, gateway_id: str) -> None:
        self.gateway_id = gateway_id
        self.instance = uuid.uuid4().hex
        self._sequence = 0
        self._totals: dict[str, int] = {}
        #: What the last report said per model (subtracted from the book's totals to get extproc's).
        self.reported: dict[str, int] = {}

    def report(
        self,
        counters: Mapping[str, tuple[int, int]],
        native: Iterable[str],
        book_in_flight: Mapping[str, int],
    ) -> demand_pb2.DemandReport:
        """One report from `counters` (model key -> (active, total) upstream requests in Envoy).

        Envoy's counts include the decided requests of the same cluster, which extproc reports
        already: only what exceeds extproc's share (the book's in-flight minus this member's last
        report) is native. Models not in `native` are reported as 0.
        """
        models = []
        reported: dict[str, int] = {}
        for key in sorted(set(native)):
            active, total = counters.get(key, (0, 0))
            before = self._totals.get(key)
            extproc = max(0, book_in_flight.get(key, 0) - self.reported.get(key, 0))
            in_flight = max(0, active - extproc)
            if in_flight == 0 and before is not None and total > before:
                in_flight = 1  # came and went between two polls
            reported[key] = in_flight
            if in_flight:
                models.append(demand_pb2.ModelDemand(model=key, in_flight=in_flight))
        self._totals = {key: total for key, (_, total) in counters.items()}
        self.reported = reported
        self._sequence += 1
        return demand_pb2.DemandReport(
            gateway_id=self.gateway_id, instance=self.instance, sequence=self._sequence, models=models
        )


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
