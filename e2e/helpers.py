"""Helpers shared by the e2e tests (the fixtures live in conftest.py)."""

from __future__ import annotations

import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from kubernetes import client
from kubernetes.client import ApiClient

from tests.support.waiting import wait_for

if TYPE_CHECKING:
    from e2e.cluster import Cluster

T = TypeVar("T")


@dataclass
class Kube:
    """Typed API groups bound to one test namespace."""

    api: ApiClient
    ns: str
    cluster: Cluster

    def __post_init__(self) -> None:
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.batch = client.BatchV1Api(self.api)
        self.discovery = client.DiscoveryV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)

    def pods(self, selector: str | None = None) -> list[Any]:
        return list(self.core.list_namespaced_pod(self.ns, label_selector=selector).items)

    def pod(self, name: str) -> Any:
        return self.core.read_namespaced_pod(name, self.ns)


def pod_pid(pod: Any, container: int = 0) -> int:
    """The local process behind a running container (the agent's containerID is e2e://PID)."""
    cid: str = pod.status.container_statuses[container].container_id
    return int(cid.removeprefix("e2e://"))


def is_ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def http_ok(url: str) -> bool:
    """Whether GET `url` answers 200 within a second."""
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def has_default_sa(core: client.CoreV1Api, ns: str) -> bool:
    return any(sa.metadata.name == "default" for sa in core.list_namespaced_service_account(ns).items)


@contextmanager
def fresh_namespace(cluster: Cluster) -> Iterator[Kube]:
    """A new namespace on `cluster` for the block, deleted after it (the real namespace controller
    then ends its pods)."""
    with cluster.api_client() as api:
        ns = f"e2e-{uuid.uuid4().hex[:8]}"
        core = client.CoreV1Api(api)
        core.create_namespace({"metadata": {"name": ns}})
        # Pods are refused until the serviceaccount controller created `default`.
        wait_for(lambda: has_default_sa(core, ns), 30, "default service account")
        yield Kube(api, ns, cluster)
        core.delete_namespace(ns)
