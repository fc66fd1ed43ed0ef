"""Pure status of a LoRAAdapter on a cluster: which of its base's pods hold it -> its `status`.

`kubectl get loraadapters` shows Base, Loaded (`loadedReplicas`), Ready and Reason from here.
Ready is True while at least one ready pod of the base holds the adapter. Otherwise the reason
tells a refused adapter (`k8s.adapters` reasons: no such base, a backend without adapters, a
source the pods cannot read, names in use, more than `maxAdapters`) from one the engine refused
(`LoadFailed`, with its answer), from a base with no ready pod (`BaseNotReady`: loaded when one
starts) and from one on its way in (`Loading`). The Ready condition keeps its
`lastTransitionTime` while its status holds, so an unchanged world computes an unchanged status.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from wakegate.control.k8s.adapters import ANNOTATION_ADAPTERS, Refused
from wakegate.control.operator.render import Condition
from wakegate.control.operator.weights import condition_dict

LOADED = "Loaded"
LOAD_FAILED = "LoadFailed"
BASE_NOT_READY = "BaseNotReady"
LOADING = "Loading"


def _ready_since(pod: Mapping[str, Any], condition: str = "Ready") -> str | None:
    """When a pod's `condition` became True (None: it is not, or the pod is going away)."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return None
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == condition and cond.get("status") == "True":
            return str(cond.get("lastTransitionTime") or pod["metadata"].get("creationTimestamp") or "")
    return None


def ready_pods(pods: Sequence[Mapping[str, Any]], condition: str = "Ready") -> dict[str, str]:
    """Ready pods of a base, by name, with when each became ready (`condition`: `ContainersReady`
    for pods whose engine answers, readiness gates aside)."""
    out = {}
    for pod in pods:
        since = _ready_since(pod, condition)
        if since is not None:
            out[str(pod["metadata"]["name"])] = since
    return out


def gate_open(pod: Mapping[str, Any], gate: str) -> bool:
    """Whether the pod condition `gate` (a readiness gate) is True."""
    return any(c.get("type") == gate and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def started_with(pods: Sequence[Mapping[str, Any]], adapter: str) -> dict[str, str]:
    """Ready pods that started with `adapter` (llama.cpp: the `--lora` list in their annotation),
    with when each became ready, which is when its engine had the adapter loaded."""
    ready = ready_pods(pods)
    out = {}
    for pod in pods:
        name = str(pod["metadata"]["name"])
        listed = ((pod["metadata"].get("annotations") or {}).get(ANNOTATION_ADAPTERS) or "").split(",")
        if name in ready and adapter in listed:
            out[name] = ready[name]
    return out


@dataclass(frozen=True)
class AdapterObserved:
    """What the operator knows of one LoRAAdapter."""

    generation: int
    base: str
    #: Why it is not served (None: its base serves it).
    refused: Refused | None = None
    #: Pods of the base holding it now -> when it was loaded there (RFC 3339).
    holders: Mapping[str, str] = field(default_factory=dict)
    #: Ready pods of the base.
    ready_replicas: int = 0
    #: Loads (pods that came to hold it) and refused loads, counted so far.
    loads: int = 0
    failures: int = 0
    #: The engine's answer to the last refused load, while no pod holds it.
    failure: str | None = None
    #: The base's engine takes adapters only at start (llama.cpp): its pods roll to get one.
    at_start: bool = False


def adapter_status(observed: AdapterObserved, previous: Mapping[str, Any], now: str) -> dict[str, Any]:
    """The LoRAAdapter's status; `previous` is its current status, `now` an RFC 3339 time."""
    holders = sorted(observed.holders)
    ready = observed.ready_replicas
    if observed.refused is not None:
        cond = Condition("Ready", "False", observed.refused.reason, observed.refused.message)
        holders = []
    elif holders:
        cond = Condition("Ready", "True", LOADED, f"loaded on {len(holders)} of {ready} ready replicas of "
                                                  f"Model {observed.base}")
    elif observed.failure is not None:
        cond = Condition("Ready", "False", LOAD_FAILED, observed.failure)
    elif ready == 0:
        cond = Condition("Ready", "False", BASE_NOT_READY, f"Model {observed.base} has no ready replica; the "
                                                           "adapter is loaded when one starts")
    elif observed.at_start:
        cond = Condition("Ready", "False", LOADING, f"the pods of Model {observed.base} roll to start with it "
                                                    f"({ready} ready without it)")
    else:
        cond = Condition("Ready", "False", LOADING, f"being loaded into {ready} ready replicas of "
                                                    f"Model {observed.base}")
    times = [observed.holders[name] for name in holders if observed.holders[name]]
    status: dict[str, Any] = {
        "loadedReplicas": len(holders),
        "replicas": holders,
        "ready": cond.status,
        "reason": cond.reason,
        "message": cond.message,
        "loads": observed.loads,
        "failures": observed.failures,
        "observedGeneration": observed.generation,
        "conditions": [condition_dict(cond, previous, now, observed.generation)],
    }
    last = max(times) if times else previous.get("lastLoadTime")
    if last:
        status["lastLoadTime"] = last
    return status
