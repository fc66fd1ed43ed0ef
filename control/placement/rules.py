"""The scheduler extender's filter rules and score formula (pure).

Filter: a GPU pod may only go to a node the wakegate agent labelled, with enough free VRAM
for the pod's estimate on each of its GPUs, and whose vendor and architecture the pod's
backend supports. Every failure is a sentence that names the rule and the numbers, because
kube-scheduler copies it into the pod's FailedScheduling event.

Score, per node (the issue's formula; units in docs/placement.md)::

    tps*w_tps - util*w_util - cost*w_cost - kvCache*w_cache + freeRatio*w_free
        - kvPenalty + tenantAdjustment + weightsCached*w_cached

(weightsCached is 1 on a node whose model cache holds the pod's weights, else 0)

then min-max normalised over the candidate nodes to 0..100 (kube-scheduler's MaxNodeScore)
and sent as 0..10 (MaxExtenderPriority), which kube-scheduler multiplies back by
weight * MaxNodeScore / MaxExtenderPriority.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

from wakegate.control.backends import BACKENDS, Backend
from wakegate.control.k8s import names
from wakegate.control.placement.facts import NodeFacts, PodFacts, number

#: kube-scheduler's node score range (framework.MaxNodeScore)
MAX_NODE_SCORE = 100
#: what an extender may answer (k8s.io/kube-scheduler/extender/v1 MaxExtenderPriority)
MAX_EXTENDER_PRIORITY = 10
#: KV-cache usage above which a node is penalised, and the penalty's slope
KV_PENALTY_THRESHOLD = 0.85
KV_PENALTY_SLOPE = 20.0


@dataclass(frozen=True)
class Verdict:
    """Why a node cannot take the pod; `resolvable` when evicting pods could change that."""

    reasons: tuple[str, ...]
    resolvable: bool

    @property
    def message(self) -> str:
        return "; ".join(self.reasons)


def _backend_reasons(pod: PodFacts, node: NodeFacts, backends: Mapping[str, Backend]) -> list[str]:
    if pod.backend is None:
        return []
    backend = backends.get(pod.backend)
    if backend is None:
        return [f"unknown backend {pod.backend!r} (annotation {names.ANNOTATION_BACKEND})"]
    if backend.gpu_vendors and node.vendor not in backend.gpu_vendors:
        return [f"backend {backend.name} does not support {node.vendor} GPUs"]
    if backend.gpu_arch:
        if node.arch is None:
            return [f"backend {backend.name} needs a known GPU arch; node has no {names.NODE_GPU_ARCH} label"]
        if node.arch not in backend.gpu_arch:
            return [f"backend {backend.name} does not support GPU arch {node.arch}"]
    return []


def filter_node(pod: PodFacts, node: NodeFacts, backends: Mapping[str, Backend] = BACKENDS) -> Verdict | None:
    """None when the node can take the pod, else every reason it cannot."""
    if pod.gpu_count <= 0:
        return None
    if node.vendor is None:
        return Verdict((f"no {names.NODE_GPU_VENDOR} label: the wakegate agent reports no GPU here",), False)
    hard: list[str] = []
    if pod.gpu_vendor is not None and pod.gpu_vendor != node.vendor:
        hard.append(f"pod requests {pod.gpu_vendor} GPUs, node has {node.vendor}")
    hard += _backend_reasons(pod, node, backends)
    soft: list[str] = []
    needed = pod.vram_needed_mb
    if needed > 0:
        if node.free_mb is None:
            hard.append(f"free VRAM unknown: no valid {names.NODE_GPU_FREE} annotation")
        elif node.free_mb < needed:
            soft.append(
                f"free VRAM {node.free_mb:.0f} MiB < {needed:.0f} MiB needed "
                f"({pod.gpu_count} GPU x {pod.vram_estimate_mb:.0f} MiB)"
            )
    if not hard and not soft:
        return None
    return Verdict(tuple(hard + soft), resolvable=not hard)


@dataclass(frozen=True)
class Weights:
    tps: float = 0.7
    util: float = 0.2
    cost: float = 0.1
    cache: float = 0.3
    vram_free: float = 10.0
    fairshare: float = 5.0
    cached: float = 50.0

    #: field -> environment variable
    ENV = {
        "tps": "SCHED_TPS_WEIGHT",
        "util": "SCHED_UTIL_WEIGHT",
        "cost": "SCHED_COST_WEIGHT",
        "cache": "SCHED_CACHE_WEIGHT",
        "vram_free": "SCHED_VRAM_FREE_WEIGHT",
        "fairshare": "SCHED_TENANT_FAIRSHARE_WEIGHT",
        "cached": "SCHED_WEIGHTS_CACHED_WEIGHT",
    }

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Weights:
        """Weights from the environment; a set but unusable value raises ValueError naming it."""
        values: dict[str, float] = {}
        for f in fields(cls):
            var = cls.ENV[f.name]
            raw = env.get(var)
            if raw is None or raw.strip() == "":
                continue
            value = number(raw, low=-math.inf)
            if value is None:
                raise ValueError(f"{var}={raw!r} is not a finite number")
            values[f.name] = value
        return cls(**values)


def kv_penalty(usage: float | None) -> float:
    if usage is None or usage <= KV_PENALTY_THRESHOLD:
        return 0.0
    return (usage - KV_PENALTY_THRESHOLD) * KV_PENALTY_SLOPE


def tenant_adjustment(pod: PodFacts, node: NodeFacts, weight: float) -> float:
    """Positive where the pod's tenant holds less than its fair share of the node, negative where more.

    Fair share = 1 / number of tenants on the node (counting the pod's own). Nothing known: 0.
    """
    if pod.tenant is None or not node.tenant_share:
        return 0.0
    tenants = set(node.tenant_share) | {pod.tenant}
    fair = 1.0 / len(tenants)
    return weight * (fair - node.tenant_share.get(pod.tenant, 0.0))


def raw_score(pod: PodFacts, node: NodeFacts, tps: float, weights: Weights) -> float:
    """The issue's formula; unknown inputs count as 0 (no bonus, no penalty)."""
    tps_value = number(tps) or 0.0
    score = (
        tps_value * weights.tps
        - (node.utilization or 0.0) * weights.util
        - (node.cost_per_hour or 0.0) * weights.cost
        - (node.kv_cache_usage or 0.0) * weights.cache
        + (node.free_ratio or 0.0) * weights.vram_free
        - kv_penalty(node.kv_cache_usage)
        + tenant_adjustment(pod, node, weights.fairshare)
        + (weights.cached if node.holds(pod.weights) else 0.0)
    )
    return score if math.isfinite(score) else 0.0


def normalise(raw: Mapping[str, float]) -> dict[str, int]:
    """Min-max to 0..MAX_NODE_SCORE: the best node gets 100, the worst 0; all equal: all 100."""
    clean = {node: (value if math.isfinite(value) else 0.0) for node, value in raw.items()}
    if not clean:
        return {}
    # halved so that the span of two huge finite scores cannot overflow to inf
    low, high = min(clean.values()) / 2, max(clean.values()) / 2
    span = high - low
    if span <= 1e-9:
        return dict.fromkeys(clean, MAX_NODE_SCORE)
    return {node: round((value / 2 - low) / span * MAX_NODE_SCORE) for node, value in clean.items()}


def extender_priority(score: int) -> int:
    """0..100 -> 0..MAX_EXTENDER_PRIORITY (kube-scheduler scales it back by 10 x weight)."""
    clamped = max(0, min(MAX_NODE_SCORE, score))
    return round(clamped * MAX_EXTENDER_PRIORITY / MAX_NODE_SCORE)
