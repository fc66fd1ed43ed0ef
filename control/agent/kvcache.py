"""The node's KV-cache usage, from the engines on it, for the `wakegate.io/kv-cache-usage` annotation.

The scheduler extender penalises nodes whose model servers are running out of KV cache
(control/placement/rules.py). The agent lists the wakegate backend pods on its own node (a
`spec.nodeName` field selector), reads each running one's metrics (the backend plugin's path on
the container's `http` port) and takes the highest usage any of them reports: the vLLM and
llama.cpp series named in wakegate/contract.py, through the backend plugins' `LoadMetrics`.
A node whose engines report none (or that has none) carries no annotation. An engine that does
not answer within the timeout is left out of that round.

`engine_targets` and `node_usage` are pure; `KvCacheReader` does the listing and the reads.
"""

from __future__ import annotations

import logging
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from wakegate.control.backends import BACKENDS
from wakegate.control.k8s import names
from wakegate.control.k8s.client import path

log = logging.getLogger("wakegate.agent")

#: The backend pods, as the operator labels them (names.backend_labels).
BACKEND_SELECTOR = f"{names.LABEL_COMPONENT}=model-backend,{names.LABEL_MANAGED_BY}={names.MANAGED_BY}"
#: Largest metrics page read from an engine.
MAX_BYTES = 1 << 20


@dataclass(frozen=True)
class Target:
    """One engine's metrics URL and the backend plugin that says which series mean KV usage."""

    pod: str
    url: str
    backend: str


def _port(pod: Mapping[str, Any]) -> int | None:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http" and isinstance(port.get("containerPort"), int):
                return int(port["containerPort"])
    return None


def engine_targets(pods: Iterable[Mapping[str, Any]], node: str) -> list[Target]:
    """The running backend pods on `node` whose engine reports KV-cache usage."""
    out: list[Target] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        status = pod.get("status") or {}
        if (pod.get("spec") or {}).get("nodeName") != node or status.get("phase") != "Running":
            continue
        if meta.get("deletionTimestamp") or not status.get("podIP"):
            continue
        annotations = meta.get("annotations") or {}
        backend = BACKENDS.get(annotations.get(names.ANNOTATION_BACKEND, ""))
        port = _port(pod)
        if backend is None or port is None or backend.load_metrics is None or not backend.load_metrics.kv_usage:
            continue
        host = status["podIP"]
        host = f"[{host}]" if ":" in host else host
        # The runtime's path as the operator wrote it on the pod, else the plugin's default.
        metrics = annotations.get(names.ANNOTATION_METRICS_PATH) or backend.metrics_path or "/metrics"
        name = f"{meta.get('namespace')}/{meta.get('name')}"
        out.append(Target(name, f"http://{host}:{port}{metrics}", backend.name))
    return out


def node_usage(values: Iterable[float | None]) -> str | None:
    """The annotation's value: the highest usage reported, 0..1 to two places; None: nobody reports."""
    known = [min(1.0, max(0.0, v)) for v in values if v is not None and v == v]
    if not known:
        return None
    return f"{max(known):.2f}"


def fetch(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - http to a pod IP
        data: bytes = response.read(MAX_BYTES)
    return data.decode("utf-8", "replace")


class PodLister(Protocol):
    def request(self, method: str, resource: str, body: Any = None, query: Mapping[str, str] | None = None) -> Any: ...


class KvCacheReader:
    """Lists the backend pods on `node` and reads their engines' KV-cache usage."""

    def __init__(
        self,
        kube: PodLister,
        node: str,
        timeout: float = 2.0,
        get: Callable[[str, float], str] = fetch,
    ) -> None:
        self.kube = kube
        self.node = node
        self.timeout = timeout
        self.get = get
        self._failing: set[str] = set()

    def pods(self) -> list[dict[str, Any]]:
        query = {"fieldSelector": f"spec.nodeName={self.node}", "labelSelector": BACKEND_SELECTOR}
        answer = self.kube.request("GET", path("v1", "Pod"), query=query) or {}
        items: list[dict[str, Any]] = answer.get("items") or []
        return items

    def read(self, target: Target) -> float | None:
        metrics = BACKENDS[target.backend].load_metrics
        assert metrics is not None
        try:
            value = metrics.kv(self.get(target.url, self.timeout))
        except (OSError, urllib.error.URLError, ValueError) as exc:
            if target.pod not in self._failing:
                log.info("node %s: no metrics from %s (%s); left out until it answers", self.node, target.pod, exc)
                self._failing.add(target.pod)
            return None
        self._failing.discard(target.pod)
        return value

    def usage(self) -> str | None:
        """The annotation's value now (raises KubeError when the pods cannot be listed)."""
        targets = engine_targets(self.pods(), self.node)
        self._failing &= {t.pod for t in targets}
        return node_usage(self.read(t) for t in targets)
