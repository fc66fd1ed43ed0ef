"""Prometheus metrics of `wakegate scaler`: demand rejections by reason, members, verdicts, scale patches,
activation leases and GPU-group swaps (the names `wakegate up` exports for the same facts), and the
demand reports refused for a missing or wrong internal token."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from wakegate.control.admin import RefusalCounts, RefusedCalls
from wakegate.control.demand.book import DemandBook
from wakegate.control.scaling.core import Core


class _StateCollector(Collector):
    """Reads the live state at scrape time instead of mirroring every change into gauges."""

    def __init__(self, book: DemandBook, core: Core, streams: Callable[[], int], leader: Callable[[], bool]) -> None:
        self._book = book
        self._core = core
        self._streams = streams
        self._leader = leader

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        rejected = CounterMetricFamily(
            "wakegate_demand_rejections", "Demand reports refused, by reason.", labels=["reason"]
        )
        for reason, count in self._book.rejections.counts().items():
            rejected.add_metric([reason], count)
        yield rejected
        yield GaugeMetricFamily("wakegate_demand_members", "Gateways with a live demand report.", self._book.members)
        yield GaugeMetricFamily("wakegate_scaler_streams", "Open StreamIsActive streams.", self._streams())
        yield GaugeMetricFamily("wakegate_scaler_leader", "1 while this scaler holds the Lease.", int(self._leader()))
        demand = GaugeMetricFamily("wakegate_model_demand", "Queued + in-flight over gateways.", labels=["model"])
        active = GaugeMetricFamily("wakegate_model_active", "1 while the model should run.", labels=["model"])
        desired = GaugeMetricFamily("wakegate_model_desired_replicas", "Replicas decided.", labels=["model"])
        for key, verdict in sorted(self._core.verdicts.items()):
            demand.add_metric([key], verdict.demand)
            active.add_metric([key], int(verdict.active))
            desired.add_metric([key], verdict.replicas)
        leases = GaugeMetricFamily(
            "wakegate_model_activation_leases", "Live activation leases over gateways.", labels=["model"]
        )
        for key in sorted(self._core.models):
            load = self._core.loads.get(key)
            leases.add_metric([key], load.leases if load is not None else 0)
        swaps = CounterMetricFamily("wakegate_gpu_swaps", "GPU-group hand-overs between models.", labels=["group"])
        for group, count in sorted(self._core.swaps.items()):
            swaps.add_metric([group], count)
        yield from (demand, active, desired, leases, swaps)


class ScalerMetrics:
    def __init__(
        self,
        book: DemandBook,
        core: Core,
        streams: Callable[[], int],
        leader: Callable[[], bool],
        refusals: RefusalCounts | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(book, core, streams, leader))
        if refusals is not None:
            # The same series `wakegate xds` exports; the demand port's refusals are also in
            # wakegate_demand_rejections_total{reason="unauthenticated"}.
            self.registry.register(RefusedCalls(refusals, ("demand",)))
        self.scale_patches = Counter(
            "wakegate_scaler_scale_patches",
            "Builtin engine: PATCHes of a Deployment's scale subresource, by result.",
            ["model", "result"],
            registry=self.registry,
        )
