"""Node and pod facts for placement, parsed from Kubernetes objects given as plain dicts.

Every number read from a label or annotation goes through :func:`number`: anything that is
not a finite number in range (missing, empty, ``NaN``, ``inf``, ``-3``, ``abc``) counts as
unknown, never as zero and never as an exception, so one bad annotation cannot stall
scheduling. Names wakegate writes for the agent live in :mod:`wakegate.control.k8s.names`; the extra
inputs of the score formula, which other tools (or people) set, are defined here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from wakegate.control.k8s import names

#: Node annotation: price of one GPU-hour on this node (any currency, same for every node).
NODE_COST_PER_HOUR = "wakegate.io/cost-per-hour"
#: Node annotation: KV-cache usage of the model servers on the node, a fraction 0..1.
NODE_KV_CACHE_USAGE = "wakegate.io/kv-cache-usage"
#: Node annotation: JSON object tenant -> fraction 0..1 of the node's GPUs that tenant holds.
NODE_TENANT_SHARE = "wakegate.io/tenant-gpu-share"
#: Pod label: the tenant a pod is accounted to (fair share).
POD_TENANT = "wakegate.io/tenant"

#: Extended resource -> vendor, as the device plugins name them.
GPU_RESOURCES: dict[str, str] = {"nvidia.com/gpu": "nvidia", "amd.com/gpu": "amd"}


def number(raw: object, *, low: float = 0.0, high: float = math.inf) -> float | None:
    """A finite number from a label/annotation value; below `low` is unknown, above `high` is `high`."""
    if isinstance(raw, bool) or raw is None:
        return None
    if isinstance(raw, int | float):
        value = float(raw)
    elif isinstance(raw, str):
        try:
            value = float(raw.strip())
        except ValueError:
            return None
    else:
        return None
    if not math.isfinite(value) or value < low:
        return None
    return min(value, high)


def _str_map(raw: object) -> dict[str, str]:
    if not isinstance(raw, Mapping):
        return {}
    return {str(k): v for k, v in raw.items() if isinstance(v, str)}


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


@dataclass(frozen=True)
class NodeFacts:
    name: str
    vendor: str | None = None
    arch: str | None = None
    #: GPUs the agent counted (label); 0 when unknown
    gpu_count: int = 0
    #: VRAM of one GPU, MiB (label)
    vram_mb: float | None = None
    #: free VRAM summed over the node's GPUs, MiB (annotation)
    free_mb: float | None = None
    #: mean GPU utilization, percent 0..100 (annotation)
    utilization: float | None = None
    cost_per_hour: float | None = None
    #: fraction 0..1
    kv_cache_usage: float | None = None
    tenant_share: Mapping[str, float] = field(default_factory=dict)
    #: `cache.wakegate.io/…` labels: the entries the node's model cache holds ready (agent)
    cached: frozenset[str] = frozenset()

    def holds(self, key: str | None) -> bool:
        """Whether the node's cache holds the entry `key` (a digest) ready."""
        return key is not None and names.cache_label(key) in self.cached

    @property
    def device_class(self) -> str | None:
        """`<vendor>-<arch>`, the bench results' device class (e.g. `nvidia-sm90`)."""
        return f"{self.vendor}-{self.arch}" if self.vendor and self.arch else None

    @property
    def free_ratio(self) -> float | None:
        """Free VRAM over total VRAM, 0..1; unknown without both numbers."""
        if self.free_mb is None or not self.vram_mb or self.gpu_count <= 0:
            return None
        return min(1.0, self.free_mb / (self.vram_mb * self.gpu_count))


def _tenant_share(raw: str | None) -> dict[str, float]:
    if not raw:
        return {}
    try:
        parsed = json.loads(raw)
    except (ValueError, RecursionError):
        return {}
    if not isinstance(parsed, dict):
        return {}
    shares: dict[str, float] = {}
    for tenant, value in parsed.items():
        share = number(value, high=1.0)
        if share is not None:
            shares[str(tenant)] = share
    return shares


def node_facts(node: Mapping[str, Any]) -> NodeFacts:
    meta = _meta(node)
    labels = _str_map(meta.get("labels"))
    annotations = _str_map(meta.get("annotations"))
    count = number(labels.get(names.NODE_GPU_COUNT))
    return NodeFacts(
        name=str(meta.get("name", "")),
        vendor=labels.get(names.NODE_GPU_VENDOR) or None,
        arch=labels.get(names.NODE_GPU_ARCH) or None,
        gpu_count=int(count) if count is not None else 0,
        vram_mb=number(labels.get(names.NODE_GPU_VRAM)),
        free_mb=number(annotations.get(names.NODE_GPU_FREE)),
        utilization=number(annotations.get(names.NODE_GPU_UTIL), high=100.0),
        cost_per_hour=number(annotations.get(NODE_COST_PER_HOUR)),
        kv_cache_usage=number(annotations.get(NODE_KV_CACHE_USAGE), high=1.0),
        tenant_share=_tenant_share(annotations.get(NODE_TENANT_SHARE)),
        cached=frozenset(k for k in labels if k.startswith(names.NODE_CACHE_PREFIX)),
    )


@dataclass(frozen=True)
class PodFacts:
    name: str
    namespace: str
    #: GPUs the pod needs (effective request, as the scheduler counts it)
    gpu_count: int = 0
    #: vendor implied by the GPU resource it requests (None when it requests none)
    gpu_vendor: str | None = None
    #: VRAM the model needs per GPU, MiB; None when the pod does not say
    vram_estimate_mb: float | None = None
    backend: str | None = None
    #: the Model's name (label wakegate.io/model)
    model: str | None = None
    tenant: str | None = None
    #: the cache entry (digest) of the weights the pod reads from its node's cache
    weights: str | None = None

    @property
    def vram_needed_mb(self) -> float:
        return (self.vram_estimate_mb or 0.0) * self.gpu_count


def _gpus(container: object) -> dict[str, int]:
    """GPU resources of one container: the larger of its limit and request per resource."""
    if not isinstance(container, Mapping):
        return {}
    resources = container.get("resources")
    if not isinstance(resources, Mapping):
        return {}
    out: dict[str, int] = {}
    for part in ("limits", "requests"):
        values = resources.get(part)
        if not isinstance(values, Mapping):
            continue
        for resource in GPU_RESOURCES:
            amount = number(values.get(resource))
            if amount is not None:
                out[resource] = max(out.get(resource, 0), int(amount))
    return out


def pod_gpu_request(pod: Mapping[str, Any]) -> dict[str, int]:
    """Effective GPU request per resource: max(sum over containers, largest init container)."""
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        return {}
    totals: dict[str, int] = {}
    containers = spec.get("containers")
    for container in containers if isinstance(containers, list) else []:
        for resource, amount in _gpus(container).items():
            totals[resource] = totals.get(resource, 0) + amount
    inits = spec.get("initContainers")
    for container in inits if isinstance(inits, list) else []:
        for resource, amount in _gpus(container).items():
            totals[resource] = max(totals.get(resource, 0), amount)
    return {resource: amount for resource, amount in totals.items() if amount > 0}


def pod_facts(pod: Mapping[str, Any]) -> PodFacts:
    meta = _meta(pod)
    labels = _str_map(meta.get("labels"))
    annotations = _str_map(meta.get("annotations"))
    request = pod_gpu_request(pod)
    vendors = [GPU_RESOURCES[resource] for resource in request]
    return PodFacts(
        name=str(meta.get("name", "")),
        namespace=str(meta.get("namespace", "")),
        gpu_count=sum(request.values()),
        gpu_vendor=vendors[0] if len(vendors) == 1 else None,
        vram_estimate_mb=number(annotations.get(names.ANNOTATION_VRAM_ESTIMATE)),
        backend=annotations.get(names.ANNOTATION_BACKEND) or None,
        model=labels.get(names.LABEL_MODEL) or None,
        tenant=labels.get(POD_TENANT) or None,
        weights=annotations.get(names.ANNOTATION_WEIGHTS) or None,
    )
