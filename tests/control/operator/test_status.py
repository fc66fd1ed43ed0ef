"""Model status from its Deployment and Pods: phases, condition reasons, stable transition times."""

from __future__ import annotations

from typing import Any

import pytest

from wakegate.control.operator.render import Condition
from wakegate.control.operator.status import Observed, compute

NOW = "2026-11-30T12:00:00Z"
AUTOSCALING = Condition("AutoscalingReady", "True", "BuiltinScaler")


def deployment(replicas: int, ready: int = 0, progress_deadline: bool = False) -> dict[str, Any]:
    conditions = []
    if progress_deadline:
        conditions.append(
            {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded", "message": "too slow"}
        )
    return {"spec": {"replicas": replicas}, "status": {"readyReplicas": ready, "conditions": conditions}}


def pod(
    node: str | None = "n0",
    ready_at: str | None = None,
    waiting: str | None = None,
    last_terminated: str | None = None,
    unschedulable: bool = False,
) -> dict[str, Any]:
    conditions: list[dict[str, Any]] = []
    if unschedulable:
        conditions.append(
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/2 nodes fit"}
        )
    if ready_at:
        conditions.append({"type": "Ready", "status": "True", "lastTransitionTime": ready_at})
    status: dict[str, Any] = {"conditions": conditions}
    if waiting or last_terminated:
        status["containerStatuses"] = [
            {
                "name": "backend",
                "image": "img",
                "state": {"waiting": {"reason": waiting}} if waiting else {"running": {}},
                "lastState": {"terminated": {"reason": last_terminated, "exitCode": 137}} if last_terminated else {},
            }
        ]
    return {
        "metadata": {"name": "p", "creationTimestamp": "2026-11-30T11:59:50Z"},
        "spec": {"nodeName": node} if node else {},
        "status": status,
    }


def status_of(dep: dict[str, Any] | None, *pods: dict[str, Any], **kw: Any) -> dict[str, Any]:
    previous = kw.pop("previous", {})
    observed = Observed(generation=2, deployment=dep, pods=list(pods), autoscaling=kw.pop("auto", AUTOSCALING), **kw)
    return compute(observed, previous, NOW)


def reason(status: dict[str, Any], type_: str = "Ready") -> str:
    return str(next(c["reason"] for c in status["conditions"] if c["type"] == type_))


def test_idle_when_scaled_to_zero() -> None:
    status = status_of(deployment(0))
    assert (status["phase"], reason(status)) == ("Idle", "ScaledToZero")
    assert status["tier"] == "zero"
    assert status_of(deployment(0), pod())["tier"] == "warm"  # a pod still terminating holds its accelerator
    assert status["admitted"] is True and status["observedGeneration"] == 2


def test_pending_loading_ready() -> None:
    assert status_of(deployment(1))["phase"] == "Pending"
    assert status_of(deployment(1), pod(node=None))["phase"] == "Pending"
    assert status_of(deployment(1), pod())["phase"] == "Loading"
    ready = status_of(deployment(1, ready=1), pod(ready_at="2026-11-30T12:00:00Z"))
    assert (ready["phase"], ready["readyReplicas"], ready["replicas"], ready["tier"]) == ("Ready", 1, 1, "warm")
    assert ready["lastColdStartSeconds"] == 10.0


def test_failure_reasons() -> None:
    cases = {
        "ImagePullBackOff": pod(waiting="ImagePullBackOff"),
        "CrashLoopBackOff": pod(waiting="CrashLoopBackOff"),
        "OOMKilled": pod(waiting="CrashLoopBackOff", last_terminated="OOMKilled"),
    }
    for expected, failing in cases.items():
        status = status_of(deployment(1), failing)
        assert (status["phase"], reason(status), reason(status, "BackendHealthy")) == ("Failed", expected, expected)
    deadline = status_of(deployment(1, progress_deadline=True), pod())
    assert (deadline["phase"], reason(deadline)) == ("Failed", "ProgressDeadlineExceeded")


def test_unschedulable_is_pending_even_past_the_progress_deadline() -> None:
    status = status_of(deployment(1, progress_deadline=True), pod(node=None, unschedulable=True))
    assert (status["phase"], reason(status)) == ("Pending", "Unschedulable")
    assert reason(status, "Schedulable") == "Unschedulable"


def test_missing_keda_without_deployment_is_pending_with_the_autoscaling_reason() -> None:
    missing = Condition("AutoscalingReady", "False", "ScaledObjectCRDMissing", "install KEDA")
    status = status_of(None, auto=missing)
    assert (status["phase"], reason(status), reason(status, "AutoscalingReady")) == (
        "Pending",
        "ScaledObjectCRDMissing",
        "ScaledObjectCRDMissing",
    )


def test_render_error_and_preemption() -> None:
    error = Condition("Ready", "False", "RuntimeNotFound", "no runtime")
    assert status_of(None, render_error=error)["phase"] == "Failed"
    preempted = status_of(deployment(1), pod(), preempted_by="ns/other")
    assert (preempted["phase"], reason(preempted), preempted["admitted"]) == ("Preempted", "Preempted", False)


@pytest.mark.parametrize(
    ("dep", "pods", "kw", "expected"),
    [
        # Demanded while the peer holds the group: Waiting names it, not Idle; not admitted.
        pytest.param(deployment(0), [], {"waiting_for": "ns/b"}, ("Waiting", "WaitingForGroup", False), id="idle"),
        # A waiting member that was swapped out: waiting for the peer says more than preempted.
        pytest.param(
            deployment(0),
            [],
            {"waiting_for": "ns/b", "preempted_by": "ns/b"},
            ("Waiting", "WaitingForGroup", False),
            id="preempted",
        ),
        # Handed the group, its start waits for the outgoing peer's pods (desired still 0).
        pytest.param(deployment(0), [], {"waiting_for": "ns/a"}, ("Waiting", "WaitingForGroup", False), id="drain"),
        # Ready replicas win: the scaler's field may lag behind a started backend.
        pytest.param(
            deployment(1, ready=1),
            [pod(ready_at=NOW)],
            {"waiting_for": "ns/b"},
            ("Ready", "BackendReady", True),
            id="ready",
        ),
        pytest.param(deployment(0), [], {}, ("Idle", "ScaledToZero", True), id="not-waiting"),
    ],
)
def test_waiting_for_a_group_peer(
    dep: dict[str, Any], pods: list[dict[str, Any]], kw: dict[str, Any], expected: tuple[str, str, bool]
) -> None:
    status = status_of(dep, *pods, **kw)
    assert (status["phase"], reason(status), status["admitted"]) == expected
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    if expected[0] == "Waiting":
        assert kw["waiting_for"] in ready["message"]
    assert "waitingFor" not in status, "the scaler owns status.waitingFor; the operator never writes it"


def test_unchanged_world_gives_unchanged_status() -> None:
    first = status_of(deployment(1, ready=1), pod(ready_at="2026-11-30T12:00:00Z"))
    later = compute(
        Observed(2, deployment(1, ready=1), [pod(ready_at="2026-11-30T12:00:00Z")], AUTOSCALING),
        first,
        "2026-11-30T13:00:00Z",
    )
    assert later == first


def test_transition_time_moves_only_when_status_changes() -> None:
    first = status_of(deployment(1), pod())
    ready = compute(
        Observed(2, deployment(1, ready=1), [pod(ready_at="2026-11-30T12:00:05Z")], AUTOSCALING),
        first,
        "2026-11-30T12:00:05Z",
    )
    times = {c["type"]: c["lastTransitionTime"] for c in ready["conditions"]}
    assert times["Ready"] == "2026-11-30T12:00:05Z"
    assert times["Schedulable"] == NOW


def test_terminating_pods_are_ignored() -> None:
    leaving = pod(waiting="CrashLoopBackOff")
    leaving["metadata"]["deletionTimestamp"] = NOW
    assert status_of(deployment(0), leaving)["phase"] == "Idle"


def test_swap_holder_is_the_peer_that_started_when_this_member_stopped() -> None:
    from wakegate.control.operator.status import swap_holder

    running = {"ns/a": True, "ns/b": False}
    assert swap_holder("ns/b", running, {"ns/a": 100.0}, {"ns/b": 98.0}) == "ns/a"
    assert swap_holder("ns/a", running, {"ns/a": 100.0}, {"ns/b": 98.0}) is None
    # Stopped long before the peer started: an idle member, not a preempted one.
    assert swap_holder("ns/b", running, {"ns/a": 500.0}, {"ns/b": 98.0}) is None
    # Never seen to stop, or the peer stopped too: not preempted.
    assert swap_holder("ns/b", running, {"ns/a": 100.0}, {}) is None
    assert swap_holder("ns/b", {"ns/a": False, "ns/b": False}, {"ns/a": 100.0}, {"ns/b": 98.0}) is None
