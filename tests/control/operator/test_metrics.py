"""The operator's series: replicas from its Deployment copies, cold-start stages from the first ready pod,
activation failures from container restarts and Failed pods (each counted once)."""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest

from wakegate.control.operator.metrics import OperatorMetrics
from wakegate.control.operator.status import cold_start_stages


def pod(
    name: str,
    *,
    created: str = "2026-12-01T10:00:00Z",
    scheduled: str | None = "2026-12-01T10:00:01Z",
    started: str | None = "2026-12-01T10:00:04Z",
    ready: str | None = "2026-12-01T10:00:10Z",
    restarts: int = 0,
    phase: str = "Running",
) -> dict[str, Any]:
    conditions = []
    if scheduled:
        conditions.append({"type": "PodScheduled", "status": "True", "lastTransitionTime": scheduled})
    if ready:
        conditions.append({"type": "Ready", "status": "True", "lastTransitionTime": ready})
    state = {"running": {"startedAt": started}} if started else {"waiting": {"reason": "ContainerCreating"}}
    return {
        "metadata": {"name": name, "uid": f"uid-{name}", "creationTimestamp": created},
        "status": {
            "phase": phase,
            "conditions": conditions,
            "containerStatuses": [{"name": "backend", "state": state, "restartCount": restarts}],
        },
    }


def samples(metrics: OperatorMetrics) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    return {
        s: float(v) for line in text.splitlines() if line and not line.startswith("#") for s, v in [line.rsplit(" ", 1)]
    }


def test_stages_come_from_the_first_pod_to_turn_ready() -> None:
    late = pod("late", created="2026-12-01T09:59:00Z", ready="2026-12-01T10:00:30Z")
    assert cold_start_stages([late, pod("first")]) == {
        "scheduled": 1.0,
        "process_start": 4.0,
        "health_pass": 6.0,
        "total": 10.0,
    }
    # A pod without a running container or a PodScheduled condition keeps the stages it can tell.
    assert cold_start_stages([pod("bare", scheduled=None, started=None)]) == {"total": 10.0}
    assert cold_start_stages([pod("loading", ready=None)]) == {}


def test_replicas_cold_starts_and_failures() -> None:
    metrics = OperatorMetrics()
    deployments: dict[str, Any] = {"ns/a": {"status": {"replicas": 2, "readyReplicas": 1}}, "ns/b": None}
    metrics.watch(lambda: deployments)
    got = samples(metrics)
    assert got['wakegate_model_replicas{model="ns/a"}'] == 2
    assert got['wakegate_model_ready_replicas{model="ns/a"}'] == 1
    assert got['wakegate_model_replicas{model="ns/b"}'] == 0
    assert got["wakegate_operator_leader"] == 0

    metrics.observe_cold_start("ns/a", [pod("first")])
    got = samples(metrics)
    assert got['wakegate_cold_starts_total{model="ns/a"}'] == 1
    assert got['wakegate_cold_start_seconds_sum{model="ns/a",stage="total"}'] == 10
    assert got['wakegate_cold_start_seconds_count{model="ns/a",stage="health_pass"}'] == 1

    metrics.observe_pod("ns/a", pod("p", restarts=0))
    assert samples(metrics)['wakegate_activation_failures_total{model="ns/a"}'] == 0
    metrics.observe_pod("ns/a", pod("p", restarts=2))
    metrics.observe_pod("ns/a", pod("p", restarts=2))  # the same restarts seen again
    assert samples(metrics)['wakegate_activation_failures_total{model="ns/a"}'] == 2
    metrics.observe_pod("ns/a", pod("p", restarts=2, phase="Failed"))
    metrics.observe_pod("ns/a", pod("p", restarts=2, phase="Failed"))
    assert samples(metrics)['wakegate_activation_failures_total{model="ns/a"}'] == 3
    metrics.observe_pod("ns/a", pod("p"), deleted=True)
    # A pod first seen after an operator restart brings its old restarts as the baseline.
    metrics.observe_pod("ns/a", pod("q", restarts=5))
    assert samples(metrics)['wakegate_activation_failures_total{model="ns/a"}'] == 3


def test_savings_on_a_cluster_are_warm_or_zero_per_replica() -> None:
    metrics = OperatorMetrics()
    deployments: dict[str, Any] = {"ns/a": {"status": {"replicas": 2}}, "ns/b": None}
    metrics.watch(lambda: deployments)
    metrics.leader = True
    samples(metrics)  # the first scrape opens each model's ledger
    deployments["ns/a"] = {"status": {"replicas": 0}}
    got = samples(metrics)
    assert got['wakegate_model_tier{model="ns/a",tier="zero"}'] == 1
    assert got['wakegate_model_tier{model="ns/b",tier="zero"}'] == 1
    assert got['wakegate_accelerator_seconds_total{model="ns/a",tier="warm"}'] > 0  # two replicas until now
    metrics.observe_cold_start("ns/a", [pod("first")])
    got = samples(metrics)
    assert got['wakegate_wake_seconds_count{model="ns/a",tier="zero"}'] == 1
    assert got['wakegate_wake_seconds_sum{model="ns/a",tier="zero"}'] == 10
