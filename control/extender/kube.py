"""Read-only mirrors of Kubernetes objects for the extender: Nodes and the bench results.

Each :class:`Mirror` lists once, then watches from the list's resourceVersion in a daemon
thread, keeping raw JSON objects (the shape kube-scheduler sends) keyed by name. A watch
that expires (410) or breaks is answered with a fresh list after a short backoff, so the
scoring path only ever reads memory.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client import ApiClient, CoreV1Api
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from wakegate.control.placement.benchdata import throughput_table

log = logging.getLogger("wakegate.extender")

#: server-side watch timeout; the watch resumes from its last resourceVersion afterwards
WATCH_SECONDS = 60
#: wait before listing again after an error
RETRY_SECONDS = 2.0

def api_client(kubeconfig: str | None) -> ApiClient:
    """The kubeconfig given, else $KUBECONFIG, else in-cluster config, else ~/.kube/config.

    Shared by the extender, the node agent and the bench.
    """
    kubeconfig = kubeconfig or os.environ.get("KUBECONFIG")
    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
        return client.ApiClient()
    return config.new_client_from_config()


Convert = Callable[[dict[str, Any]], dict[str, Any]]


def _slim_node(node: dict[str, Any]) -> dict[str, Any]:
    """What the rules read from a Node: name, labels, annotations (a Node can be 10+ KiB)."""
    meta = node.get("metadata") or {}
    return {"metadata": {k: meta[k] for k in ("name", "labels", "annotations") if k in meta}}


class Mirror:
    """Objects of one list call, by metadata.name, kept current by a watch."""

    def __init__(self, what: str, list_fn: Callable[..., Any], convert: Convert, **list_kwargs: Any) -> None:
        self.what = what
        self.list_fn = list_fn
        self.convert = convert
        self.list_kwargs = list_kwargs
        self.synced = threading.Event()
        self._items: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self.on_change: Callable[[], None] = lambda: None

    def get(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            return self._items.get(name)

    def _list(self) -> str:
        resp = self.list_fn(_preload_content=False, **self.list_kwargs)
        try:
            listing = json.loads(resp.data)
        finally:
            resp.release_conn()
        items = {}
        for obj in listing.get("items") or []:
            items[obj["metadata"]["name"]] = self.convert(obj)
        with self._lock:
            self._items = items
        self.on_change()
        self.synced.set()
        version: str = listing["metadata"]["resourceVersion"]
        return version

    def _apply(self, event: Mapping[str, Any]) -> None:
        kind = event.get("type")
        obj = event.get("object")
        if kind not in ("ADDED", "MODIFIED", "DELETED") or not isinstance(obj, dict):
            return
        name = obj["metadata"]["name"]
        with self._lock:
            if kind == "DELETED":
                self._items.pop(name, None)
            else:
                self._items[name] = self.convert(obj)
        self.on_change()

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                version = self._list()
                while not stop.is_set():
                    w = watch.Watch()
                    for event in w.stream(
                        self.list_fn, resource_version=version, timeout_seconds=WATCH_SECONDS,
                        allow_watch_bookmarks=True, deserialize=False, **self.list_kwargs,
                    ):
                        self._apply(event)
                        if stop.is_set():
                            w.stop()
                    version = w.resource_version or version
            except ApiException as exc:
                if exc.status != 410:
                    log.warning("%s watch failed (%s %s); listing again", self.what, exc.status, exc.reason)
            except (HTTPError, OSError, ValueError, KeyError) as exc:
                log.warning("%s watch broke (%r); listing again in %.0fs", self.what, exc, RETRY_SECONDS)
                stop.wait(RETRY_SECONDS)

    def start(self, stop: threading.Event) -> threading.Thread:
        thread = threading.Thread(target=self.run, args=(stop,), name=f"mirror-{self.what}", daemon=True)
        thread.start()
        return thread


class ClusterSources:
    """Nodes and bench throughput from the API server, for the extender's handlers."""

    def __init__(self, core: CoreV1Api, bench_namespace: str, bench_configmap: str) -> None:
        self.nodes = Mirror("nodes", core.list_node, _slim_node)
        self.bench = Mirror(
            f"configmap {bench_namespace}/{bench_configmap}",
            core.list_namespaced_config_map,
            lambda cm: {"data": cm.get("data") or {}},
            namespace=bench_namespace,
            field_selector=f"metadata.name={bench_configmap}",
        )
        self.bench_configmap = bench_configmap
        self._throughput: dict[str, float] = {}
        self.bench.on_change = self._reload_bench

    def _reload_bench(self) -> None:
        cm = self.bench.get(self.bench_configmap)
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
