"""Names, labels and annotations of the objects wakegate manages on a cluster.

One place, so the operator that creates a Model's backend, the feeder that
routes to it, the scaler that scales it and the scheduler extender that places
it all agree on what to look for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

GROUP = "wakegate.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
MODEL_PLURAL = "models"
RUNTIME_PLURAL = "inferenceruntimes"
MODELCACHE_PLURAL = "modelcaches"
MODELCATALOG_PLURAL = "modelcatalogs"
LORAADAPTER_PLURAL = "loraadapters"

#: Server-side apply field manager of the operator (one manager for everything it applies).
FIELD_MANAGER = "wakegate-operator"
#: Field manager of the builtin scaling engine (it owns only spec.replicas via the scale subresource).
SCALER_FIELD_MANAGER = "wakegate-scaler"
#: Field manager of the GPU node agent's label and annotation patches.
AGENT_FIELD_MANAGER = "wakegate-agent"
#: Field manager of `wakegate bench` writing its results ConfigMap.
BENCH_FIELD_MANAGER = "wakegate-bench"

#: Model status field the scaler writes: the GPU-group peer a demanded member waits for.
STATUS_WAITING_FOR = "waitingFor"

LABEL_MODEL = "wakegate.io/model"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_NAME = "app.kubernetes.io/name"
MANAGED_BY = "wakegate"

#: Pod annotation: the model's VRAM need per GPU, MiB (read by the scheduler extender).
ANNOTATION_VRAM_ESTIMATE = "wakegate.io/vram-estimate-mb"
#: Pod annotation: backend plugin name (the extender checks its supported GPU architectures).
ANNOTATION_BACKEND = "wakegate.io/backend"

#: Pod annotation: the path of the engine's Prometheus metrics on its `http` port (the InferenceRuntime's
#: spec.metrics.path), written only when the runtime names a metrics prefix (the engine exports
#: series). The chart's backend PodMonitor scrapes this path and skips pods without it.
ANNOTATION_METRICS_PATH = "wakegate.io/metrics-path"
#: Pod annotation: the prefix of the engine's series (spec.metrics.prefix: `vllm:`, `llamacpp:`).
ANNOTATION_METRICS_PREFIX = "wakegate.io/metrics-prefix"

#: Node labels and annotations written by the GPU node agent.
NODE_GPU_VENDOR = "wakegate.io/gpu.vendor"
NODE_GPU_ARCH = "wakegate.io/gpu.arch"
NODE_GPU_COUNT = "wakegate.io/gpu.count"
NODE_GPU_VRAM = "wakegate.io/gpu.vram-mb"
NODE_GPU_FREE = "wakegate.io/gpu-free-memory-mb"
NODE_GPU_UTIL = "wakegate.io/gpu-utilization"

#: Node label prefix: one label per cache entry the node's cache holds ready (`cache_label`).
NODE_CACHE_PREFIX = "cache.wakegate.io/"
#: Pod annotation: the cache key (digest) of the weights the pod reads from its node's cache;
#: the scheduler extender scores nodes holding it higher.
ANNOTATION_WEIGHTS = "wakegate.io/weights"
#: Where the node agent keeps each node's model cache (a hostPath), unless configured otherwise.
NODE_CACHE_DIR = "/var/lib/wakegate/cache"

#: Longest Model name: "wg-" + name must stay a valid 63-character Service name.
MAX_MODEL_NAME = 60


def backend_name(model_name: str) -> str:
    """Deployment, Service, PodDisruptionBudget and ScaledObject of a Model share this name."""
    return f"wg-{model_name}"


def model_key(namespace: str, name: str) -> str:
    """The model's key in routes and demand reports."""
    return f"{namespace}/{name}"


def owning_model_key(metadata: Mapping[str, Any]) -> str | None:
    """The key of the Model a backend object (Deployment, Pod, EndpointSlice) belongs to, by its label."""
    model = (metadata.get("labels") or {}).get(LABEL_MODEL)
    return model_key(metadata["namespace"], model) if model else None


def backend_labels(model_name: str) -> dict[str, str]:
    """Labels on every object rendered for a Model, and the backend pods' selector."""
    return {
        LABEL_NAME: "wakegate-backend",
        LABEL_COMPONENT: "model-backend",
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_MODEL: model_name,
    }


def selector_labels(model_name: str) -> dict[str, str]:
    return {LABEL_MODEL: model_name, LABEL_NAME: "wakegate-backend"}


def cache_label(key: str) -> str:
    """The Node label saying the node's cache holds entry `key` (`sha256:HEX`) ready.

    `cache.wakegate.io/sha256-` and the first 56 hex digits: a label name has at most 63
    characters, and 224 bits still name one entry.
    """
    return NODE_CACHE_PREFIX + key.replace(":", "-", 1)[:63]


def agent_cache_manager(node: str) -> str:
    """The field manager of one node's agent in ModelCache status: each owns only its node's entries."""
    return f"wakegate-agent/{node}"[:128]


def owned_cache_name(model_name: str) -> str:
    """The ModelCache the operator keeps for a `cache: prewarm` Model no other ModelCache names."""
    return backend_name(model_name)
