"""Prometheus metrics of `wakegate operator`: what it sees of each Model's backend, under the names
`wakegate up` exports for the same facts (replicas, ready replicas, cold starts and their stages,
activation failures), so the dashboards and alerts read one set of series on both.

Gauges are read from the reconciler's copies of the Deployments at scrape time; the counters and the
histogram are fed by the reconciler as it sees pods change. Only the leader reconciles: a standby
exports its leader gauge at 0 and no model series.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from wakegate.control.admin import COLD_START_BUCKETS
from wakegate.control.operator.status import cold_start_stages, restarts
from wakegate.control.savings.metrics import TierCollector, wake_histogram
from wakegate.control.scaling.savings import Ledger

#: model key -> its backend Deployment (None: not created yet, or scaled away and deleted)
Deployments = Callable[[], Mapping[str, Mapping[str, Any] | None]]


class _Replicas(Collector):
    def __init__(self, deployments: Deployments, leader: Callable[[], bool]) -> None:
        self._deployments = deployments
        self._leader = leader

    def collect(self) -> Iterator[GaugeMetricFamily]:
        replicas = GaugeMetricFamily("wakegate_model_replicas", "Backend replicas (any state).", labels=["model"])
        ready = GaugeMetricFamily("wakegate_model_ready_replicas", "Backend replicas passing health.", labels=["model"])
        for key, deployment in sorted(self._deployments().items()):
            status = (deployment or {}).get("status") or {}
            replicas.add_metric([key], int(status.get("replicas") or 0))
            ready.add_metric([key], int(status.get("readyReplicas") or 0))
        yield replicas
        yield ready
        yield GaugeMetricFamily(
            "wakegate_operator_leader", "1 while this operator holds the Lease.", int(self._leader())
        )


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.leader = False
        self._deployments: Deployments = dict
        self.registry.register(_Replicas(lambda: self._deployments(), lambda: self.leader))
        self.cold_start = Histogram(
            "wakegate_cold_start_seconds",
            "Cold start of a model from zero ready replicas, by stage, from its first pod to turn ready: "
            "scheduled (pod created to bound), process_start (created to the engine running), health_pass "
            "(running to Ready), total (created to Ready).",
            ["model", "stage"],
            buckets=COLD_START_BUCKETS,
            registry=self.registry,
        )
        self.cold_starts = Counter(
            "wakegate_cold_starts", "Starts from zero ready replicas.", ["model"], registry=self.registry
        )
        self.activation_failures = Counter(
            "wakegate_activation_failures",
            "Backend containers that crashed or were killed (restarts, pods that ended Failed).",
            ["model"],
            registry=self.registry,
        )
        #: pod uid -> (restarts seen, counted as failed)
        self._pods: dict[str, tuple[int, bool]] = {}
        # Savings on a cluster: warm while the Deployment has replicas, else zero (no asleep tier
        # there), one unit per replica; wakes from zero are the cold starts.
        self.ledger = Ledger()
        self.registry.register(TierCollector(self.ledger, refresh=self._tiers))
        self.wake_seconds = wake_histogram(self.registry)

    def _tiers(self) -> None:
        if not self.leader:
            return
        now = time.time()
        for key, deployment in self._deployments().items():
            replicas = int(((deployment or {}).get("status") or {}).get("replicas") or 0)
            self.ledger.observe(key, "warm" if replicas else "zero", max(1, replicas), now)

    def watch(self, deployments: Deployments) -> None:
        """Read the replica gauges from these Deployments (the reconciler's copies)."""
        self._deployments = deployments

    def observe_cold_start(self, key: str, pods: Sequence[Mapping[str, Any]]) -> None:
        """The model just turned ready from zero ready replicas."""
        self.cold_starts.labels(key).inc()
        for stage, seconds in cold_start_stages(pods).items():
            self.cold_start.labels(key, stage).observe(seconds)
            if stage == "total":
                self._tiers()
                self.ledger.wake(key, "zero", seconds, time.time())
                self.wake_seconds.labels(key, "zero").observe(seconds)

    def observe_pod(self, key: str, pod: Mapping[str, Any], deleted: bool = False) -> None:
        """Count what failed in a backend pod since it was last seen: container restarts, phase Failed."""
        uid = str(pod["metadata"].get("uid") or pod["metadata"].get("name"))
        if deleted:
            self._pods.pop(uid, None)
            return
        self.activation_failures.labels(key)  # the series exists (at 0) from the first pod on
        count, failed = restarts(pod), (pod.get("status") or {}).get("phase") == "Failed"
        seen = self._pods.get(uid)
        if seen is not None:
            new = max(0, count - seen[0]) + int(failed and not seen[1])
            if new:
                self.activation_failures.labels(key).inc(new)
        elif failed:
            self.activation_failures.labels(key).inc()
        self._pods[uid] = (max(count, seen[0] if seen else 0), failed or bool(seen and seen[1]))
