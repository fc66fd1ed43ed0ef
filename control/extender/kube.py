"""The extender's cluster sources: read-only copies of the Nodes and of the bench results ConfigMap.

Both are kept current by a list+watch thread (wakegate.control.k8s.watch), so the scoring
path only ever reads memory. Nodes are slimmed to what the rules read (a Node can be 10+ KiB).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from wakegate.control.k8s.client import Kube, path
from wakegate.control.k8s.watch import ListWatch
from wakegate.control.placement.benchdata import throughput_table


def _slim_node(node: dict[str, Any]) -> dict[str, Any]:
    """What the rules read from a Node: name, labels, annotations."""
    meta = node.get("metadata") or {}
    return {"metadata": {k: meta[k] for k in ("name", "labels", "annotations") if k in meta}}


class ClusterSources:
    """Nodes and bench throughput from the API server, for the extender's handlers."""

    def __init__(self, kube: Kube, bench_namespace: str, bench_configmap: str) -> None:
        self.nodes = ListWatch(kube, "nodes", path("v1", "Node"), convert=_slim_node)
        self.bench = ListWatch(
            kube,
            f"configmap {bench_namespace}/{bench_configmap}",
            path("v1", "ConfigMap", bench_namespace),
            query={"fieldSelector": f"metadata.name={bench_configmap}"},
            convert=lambda cm: {"data": cm.get("data") or {}},
            on_change=self._reload_bench,
        )
        self.bench_namespace = bench_namespace
        self.bench_configmap = bench_configmap
        self._throughput: dict[str, float] = {}

    def _reload_bench(self, watch: ListWatch) -> None:
        cm = watch.get(self.bench_configmap, self.bench_namespace)
        self._throughput = throughput_table(cm["data"] if cm else None)

    def start(self, stop: threading.Event) -> None:
        self.nodes.start(stop)
        self.bench.start(stop)

    def node(self, name: str) -> Mapping[str, Any] | None:
        return self.nodes.get(name)

    def throughput(self, key: str) -> float | None:
        return self._throughput.get(key)

    def ready(self) -> bool:
        return self.nodes.synced.is_set() and self.bench.synced.is_set()
