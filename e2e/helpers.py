"""Helpers shared by the e2e tests (the fixtures live in conftest.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
from kubernetes import client
from kubernetes.client import ApiClient

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


def wait_for(check: Callable[[], T], timeout: float, what: str, every: float = 0.25) -> T:
    """Poll until `check()` is truthy; return its value or fail naming `what`."""
    deadline = time.monotonic() + timeout
    last: T = check()
    while not last:
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
        time.sleep(every)
        last = check()
    return last
