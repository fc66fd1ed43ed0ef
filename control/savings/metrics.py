"""The savings series, one definition for `wakegate up` and the operator: accelerator-seconds per
tier and the tier now (read from a `Ledger` at scrape time), and the wakes histogram."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from wakegate.control.admin import COLD_START_BUCKETS
from wakegate.control.scaling.savings import TIERS, Ledger

#: Name of the savings counter; `wakegate savings` and the dashboards read it by this name.
ACCELERATOR_SECONDS = "wakegate_accelerator_seconds"
WAKE_SECONDS = "wakegate_wake_seconds"


class TierCollector(Collector):
    """Each model's tier and the accelerator-seconds it spent in each, as of the scrape."""

    def __init__(
        self, ledger: Ledger, clock: Callable[[], float] = time.time, refresh: Callable[[], None] = lambda: None
    ) -> None:
        self.ledger = ledger
        self.clock = clock
        #: Brings the ledger up to date first (the operator: from the Deployments it holds).
        self.refresh = refresh

    def collect(self) -> Iterator[Metric]:
        self.refresh()
        seconds = CounterMetricFamily(
            ACCELERATOR_SECONDS,
            "Accelerator-seconds per model and tier: warm (held: replicas that hold their accelerators), "
            "asleep (released: the process lives, the engine let go of the model) and zero (released: no "
            "process). A replica without an accelerator counts as one.",
            labels=["model", "tier"],
        )
        tier = GaugeMetricFamily(
            "wakegate_model_tier", "1 for the tier each model is in now.", labels=["model", "tier"]
        )
        for model, totals in self.ledger.totals(self.clock()).items():
            now = self.ledger.tier(model)
            for name in TIERS:
                seconds.add_metric([model, name], totals[name])
                tier.add_metric([model, name], 1.0 if name == now else 0.0)
        yield seconds
        yield tier

    def describe(self) -> Iterator[Metric]:
        return iter(())


def wake_histogram(registry: CollectorRegistry) -> Histogram:
    return Histogram(
        WAKE_SECONDS,
        "Each wake by the tier it woke from (asleep: the engine's own wake; zero: a start), from the "
        "demand that woke it to the model routed: the waiting it cost (_sum) and how many (_count).",
        ["model", "tier"],
        buckets=COLD_START_BUCKETS,
        registry=registry,
    )
