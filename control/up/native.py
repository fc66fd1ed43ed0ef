"""Demand of the requests Envoy routes alone (the native path), from Envoy's own counters.

extproc never sees a natively routed request, so its demand reports miss them. `wakegate up`
polls its Envoy's per-cluster counters (wakegate.envoycounters) and reports what only Envoy saw
as one more member of the same demand book, so idle timers, drains and autoscaling count native
requests exactly like decided ones. Pure: the polling is the caller's.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping

from wakegate.envoycounters import NativeInFlight
from wakegate.v1 import demand_pb2


class NativeDemand:
    """Turns Envoy's per-cluster counters into DemandReports of the native requests."""

    def __init__(self, gateway_id: str) -> None:
        self.gateway_id = gateway_id
        self.instance = uuid.uuid4().hex
        self._sequence = 0
        self._native = NativeInFlight()
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
        already: extproc's share is the book's in-flight minus this member's last report.
        Models not in `native` are reported as 0.
        """
        keys = set(native)
        extproc = {key: max(0, book_in_flight.get(key, 0) - self.reported.get(key, 0)) for key in keys}
        self.reported = self._native.update(counters, keys, extproc)
        self._sequence += 1
        models = [demand_pb2.ModelDemand(model=key, in_flight=n) for key, n in self.reported.items() if n]
        return demand_pb2.DemandReport(
            gateway_id=self.gateway_id, instance=self.instance, sequence=self._sequence, models=models
        )
