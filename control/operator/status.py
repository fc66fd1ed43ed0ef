"""Pure status: a Model's backend Deployment and Pods (plain dicts) -> its `status` (phase + conditions).

Phases: Idle (scaled to zero), Pending (waiting for a node or for autoscaling),
Loading (scheduled, not ready), Ready, Failed (the backend cannot start: image
pull, crash loop, OOM, progress deadline, unusable runtime), Waiting (it has demand
but a GPU-group peer holds the accelerator, or is still draining off it: the scaler
names that peer in `status.waitingFor`), Preempted (it was
swapped out of its GPU group and the peer that took the accelerator still runs). Condition reasons are stable
strings so `kubectl get mdl` tells a scheduling delay from a broken image.
Conditions keep their `lastTransitionTime` while their status does not change,
so an unchanged world computes an unchanged status (no write, no update loop).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from wakegate.control.feeder.native import routing_path
from wakegate.control.feeder.routed import routed_model
from wakegate.control.feeder.settings import GatewaySettings
from wakegate.control.operator.render import Condition
from wakegate.control.operator.weights import State, Weights, condition_dict
from wakegate.control.schema import Model

PULL_FAILURES = ("ImagePullBackOff", "ErrImagePull", "InvalidImageName")


@dataclass(frozen=True)
class Observed:
    """What the operator sees of one Model's world."""

    generation: int
    deployment: Mapping[str, Any] | None
    pods: Sequence[Mapping[str, Any]]
    autoscaling: Condition
    #: Set when rendering failed (no runtime, unusable accelerator...).
    render_error: Condition | None = None
    #: GPU group member that holds the group, when it is not this Model.
    preempted_by: str | None = None
    #: The GPU-group peer this demanded Model waits for (`status.waitingFor`, from the scaler).
    waiting_for: str | None = None
    #: Where the weights stand in the node caches (`cache: node|prewarm` only).
    weights: Weights | None = None


def _time(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _pod_failure(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """(reason, message) when a backend container cannot run."""
    status = pod.get("status") or {}
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        terminated = (cs.get("state") or {}).get("terminated") or {}
        last = (cs.get("lastState") or {}).get("terminated") or {}
        if waiting.get("reason") in PULL_FAILURES:
            return "ImagePullBackOff", waiting.get("message") or f"cannot pull {cs.get('image')}"
        if "OOMKilled" in (terminated.get("reason"), last.get("reason")):
            return "OOMKilled", f"container {cs.get('name')} was killed for memory (exit 137)"
        if waiting.get("reason") == "CrashLoopBackOff":
            code = last.get("exitCode")
            return "CrashLoopBackOff", f"container {cs.get('name')} keeps exiting (last exit code {code})"
    return None


def failed_pods(pods: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(name, why) of the pods that ended in phase Failed and are not being deleted yet.

    A Deployment's pods restart in place, so phase Failed means the pod itself is finished
    (evicted, its node shut down, preempted): the ReplicaSet has replaced it, nothing will
    restart it, and it would otherwise stay until the cluster's pod garbage collection.
    """
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        status = pod.get("status") or {}
        if status.get("phase") != "Failed" or meta.get("deletionTimestamp"):
            continue
        why = ": ".join(str(p) for p in (status.get("reason"), status.get("message")) if p) or "failed"
        out.append((str(meta.get("name")), why))
    return out


def _unschedulable(pod: Mapping[str, Any]) -> str | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return str(cond.get("message") or cond.get("reason") or "Unschedulable")
    return None


def _ready_condition(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The pod's `Ready` condition when it is True; None while the pod is not ready."""
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready" and cond.get("status") == "True":
            return cond  # type: ignore[no-any-return]
    return None


def _pod_ready(pod: Mapping[str, Any]) -> datetime | None:
    cond = _ready_condition(pod)
    if cond is None:
        return None
    return _time(cond.get("lastTransitionTime")) or _time(pod["metadata"].get("creationTimestamp"))


def _progress_deadline(deployment: Mapping[str, Any]) -> str | None:
    for cond in (deployment.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return str(cond.get("message") or "ProgressDeadlineExceeded")
    return None


def cold_start_seconds(pods: Sequence[Mapping[str, Any]]) -> float | None:
    """Creation to Ready of the first ready pod: how long the model took to come up from nothing."""
    spans = []
    for pod in pods:
        if pod["metadata"].get("deletionTimestamp"):
            continue
        ready = _pod_ready(pod)
        created = _time(pod["metadata"].get("creationTimestamp"))
        if ready is not None and created is not None:
            spans.append((ready, (ready - created).total_seconds()))
    return round(min(spans)[1], 3) if spans else None


def _started(pod: Mapping[str, Any]) -> datetime | None:
    """When the pod's first container last started running."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        started = _time(((cs.get("state") or {}).get("running") or {}).get("startedAt"))
        if started is not None:
            return started
    return None


def _scheduled(pod: Mapping[str, Any]) -> datetime | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "True":
            return _time(cond.get("lastTransitionTime"))
    return None


def cold_start_stages(pods: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The stages of a cold start, from the first pod to turn ready, in seconds.

    The clock starts when the pod is created (the scaler's scale-up, a moment later): `scheduled`
    (created to bound to a node), `process_start` (created to the engine container running: scheduling,
    image pull, volumes), `health_pass` (running to Ready: the engine's load and probes) and `total`
    (created to Ready). A stage whose times the pod does not carry is left out.
    """
    first: tuple[datetime, Mapping[str, Any]] | None = None
    for pod in pods:
        ready = _pod_ready(pod)
        if ready is not None and not pod["metadata"].get("deletionTimestamp") and (first is None or ready < first[0]):
            first = (ready, pod)
    if first is None:
        return {}
    ready, pod = first
    created = _time(pod["metadata"].get("creationTimestamp"))
    if created is None:
        return {}
    started, scheduled = _started(pod), _scheduled(pod)
    spans = {
        "scheduled": (created, scheduled),
        "process_start": (created, started),
        "health_pass": (started, ready),
        "total": (created, ready),
    }
    return {
        stage: max(0.0, (end - begin).total_seconds())
        for stage, (begin, end) in spans.items()
        if begin is not None and end is not None
    }


def restarts(pod: Mapping[str, Any]) -> int:
    """Container restarts of a pod so far (crashes, OOM kills, failed liveness probes)."""
    return sum(int(cs.get("restartCount") or 0) for cs in (pod.get("status") or {}).get("containerStatuses") or [])


#: A member stopping within this many seconds of a group peer starting was swapped out (preempted).
SWAP_WINDOW_SECONDS = 60.0


def swap_holder(
    key: str,
    running: Mapping[str, bool],
    started_at: Mapping[str, float],
    stopped_at: Mapping[str, float],
    window: float = SWAP_WINDOW_SECONDS,
) -> str | None:
    """The GPU-group peer that displaced `key`, if `key` was swapped out and that peer still runs.

    The scaler (builtin or via KEDA) arbitrates the group and scales members;
    the operator sees only its outcome: `key` stopped while a peer started.
    `running` covers the group's members; the times are when each was last
    seen to start and to stop (any monotonic clock).
    """
    if running.get(key, False) or key not in stopped_at:
        return None
    for peer, up in sorted(running.items()):
        if peer != key and up and abs(started_at.get(peer, -math.inf) - stopped_at[key]) <= window:
            return peer
    return None


def compute(observed: Observed, previous: Mapping[str, Any], now: str) -> dict[str, Any]:
    """The Model's status; `previous` is its current status, `now` an RFC 3339 time."""
    live = [p for p in observed.pods if not p["metadata"].get("deletionTimestamp")]
    dep = observed.deployment
    dep_status = (dep or {}).get("status") or {}
    desired = int(((dep or {}).get("spec") or {}).get("replicas", 0) or 0)
    ready = int(dep_status.get("readyReplicas", 0) or 0)
    failures = [f for p in live if (f := _pod_failure(p)) is not None]
    unschedulable = [u for p in live if (u := _unschedulable(p)) is not None]
    deadline = _progress_deadline(dep) if dep is not None else None

    schedulable = Condition("Schedulable", "True", "Scheduled")
    if unschedulable:
        schedulable = Condition("Schedulable", "False", "Unschedulable", unschedulable[0])
    healthy = Condition("BackendHealthy", "True", "Healthy")
    if failures:
        healthy = Condition("BackendHealthy", "False", failures[0][0], failures[0][1])
    elif deadline is not None:
        healthy = Condition("BackendHealthy", "False", "ProgressDeadlineExceeded", deadline)

    weights = observed.weights
    if observed.render_error is not None:
        phase, why = "Failed", observed.render_error
    elif weights is not None and weights.state is State.FAILED:
        phase, why = "Failed", Condition("Ready", "False", "PrewarmFailed", weights.message)
    elif weights is not None and weights.digest is None and dep is None:
        phase, why = "Pending", Condition("Ready", "False", "WeightsPulling", weights.message)
    elif observed.waiting_for is not None and ready == 0:
        phase, why = "Waiting", Condition(
            "Ready", "False", "WaitingForGroup", f"waiting for GPU group peer {observed.waiting_for}"
        )
    elif observed.preempted_by is not None:
        phase, why = "Preempted", Condition("Ready", "False", "Preempted", f"GPU group held by {observed.preempted_by}")
    elif dep is None and observed.autoscaling.status != "True":
        phase, why = "Pending", observed.autoscaling
    elif ready > 0:
        phase, why = "Ready", Condition("Ready", "True", "BackendReady", f"{ready} ready replica(s)")
    elif failures:
        phase, why = "Failed", healthy
    elif unschedulable:
        # A progress deadline passed while no node fits is still a scheduling problem.
        phase, why = "Pending", schedulable
    elif healthy.status == "False":
        phase, why = "Failed", healthy
    elif desired == 0 and not live:
        phase, why = "Idle", Condition("Ready", "False", "ScaledToZero", "no replicas; the next request wakes it")
    elif live and all(((p.get("spec") or {}).get("nodeName")) for p in live):
        phase, why = "Loading", Condition("Ready", "False", "Loading", "backend is starting")
    else:
        phase, why = "Pending", Condition("Ready", "False", "Pending", "waiting for a backend pod")
    ready_cond = Condition("Ready", why.status if why.type == "Ready" else "False", why.reason, why.message)

    extra = weights.conditions if weights is not None else ()
    conditions = [
        condition_dict(cond, previous, now, observed.generation)
        for cond in (ready_cond, schedulable, observed.autoscaling, healthy, *extra)
    ]
    status: dict[str, Any] = {
        "phase": phase,
        "readyReplicas": ready,
        "replicas": desired,
        # Pods that exist hold their accelerators, terminating ones included.
        "tier": "warm" if desired > 0 or observed.pods else "zero",
        "observedGeneration": observed.generation,
        "admitted": observed.preempted_by is None and phase != "Waiting",
        "conditions": conditions,
    }
    cold = previous.get("lastColdStartSeconds")
    if ready > 0 and int(previous.get("readyReplicas", 0) or 0) == 0:
        cold = cold_start_seconds(live) or cold
    if cold is not None:
        status["lastColdStartSeconds"] = cold
    return status


def routing_path_status(
    model: Model, pods: Sequence[Mapping[str, Any]], admitted: bool, native_allowed: bool
) -> dict[str, Any]:
    """`routingPath` (native or decided) and `routingPathReason` of a Model on a cluster.

    The same verdict the feeder routes by (native.native_blocker over the Model as the gateway
    sees it, LoRAAdapters included): its pods that are ready stand for the ready endpoints the
    feeder reads from their EndpointSlices. `model` carries its adapters (`with_adapters`);
    `admitted` is the status's; `native_allowed` is the operator's `--native-path`, as the
    feeder's. A native Model's reason is None: the merge patch of the status removes the field.
    """
    ready = sorted(
        (str(pod["status"]["podIP"]), 0)
        for pod in pods
        if not pod["metadata"].get("deletionTimestamp")
        and (pod.get("status") or {}).get("podIP")
        and _ready_condition(pod) is not None
    )
    settings = GatewaySettings(native_allowed=native_allowed)
    verdict = routing_path(routed_model(model, ready, admitted=admitted), settings)
    return {"routingPathReason": None, **verdict}
