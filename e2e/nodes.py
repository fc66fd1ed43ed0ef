"""Fake GPU nodes: what the node agent registers and keeps alive.

Default profiles alternate an NVIDIA node and an AMD node, labelled the way
NVIDIA's GPU feature discovery and AMD's node labeller label real machines, so
the scheduler extender and GPU agent logic see familiar facts.
"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from e2e.kubeapi import ApiError, KubeAPI

log = logging.getLogger("e2e.nodeagent")

#: how often the node lease is renewed (the kubelet default)
LEASE_RENEW_SECONDS = 10.0
LEASE_DURATION_SECONDS = 40
#: how often the Ready condition's heartbeat is refreshed
STATUS_SECONDS = 30.0

KUBELET_VERSION = "v1.36.3"

_BASE_CAPACITY = {"cpu": "32", "memory": "256Gi", "pods": "110", "ephemeral-storage": "500Gi"}

NVIDIA = {
    "labels": {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "nvidia.com/gpu.memory": "81559",
        "nvidia.com/gpu.count": "4",
        "nvidia.com/gpu.family": "hopper",
    },
    "capacity": {"nvidia.com/gpu": "4"},
}
AMD = {
    "labels": {
        "amd.com/gpu.present": "true",
        "amd.com/gpu.product-name": "AMD_Instinct_MI300X",
        "amd.com/gpu.vram": "192G",
        "amd.com/gpu.count": "4",
        "amd.com/gpu.family": "AI",
    },
    "capacity": {"amd.com/gpu": "4"},
}


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class NodeSpec:
    name: str
    labels: dict[str, str] = field(default_factory=dict)
    capacity: dict[str, str] = field(default_factory=dict)
    taints: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> NodeSpec:
        return cls(
            name=raw["name"],
            labels={k: str(v) for k, v in (raw.get("labels") or {}).items()},
            capacity={k: str(v) for k, v in (raw.get("capacity") or {}).items()},
            taints=list(raw.get("taints") or []),
        )


def default_nodes(count: int, prefix: str = "e2e-node") -> list[NodeSpec]:
    specs = []
    for i in range(count):
        profile = NVIDIA if i % 2 == 0 else AMD
        specs.append(NodeSpec(
            name=f"{prefix}-{i}",
            labels=dict(profile["labels"]),
            capacity=dict(profile["capacity"]),
        ))
    return specs


def load_nodes(path: Path) -> list[NodeSpec]:
    """A YAML list of {name, labels, capacity, taints}; capacity adds to cpu/memory/pods defaults."""
    return [NodeSpec.from_dict(raw) for raw in yaml.safe_load(path.read_text())]


def _conditions(heartbeat: str, since: str) -> list[dict[str, str]]:
    def cond(type_: str, status: str, reason: str, message: str) -> dict[str, str]:
        return {
            "type": type_, "status": status, "reason": reason, "message": message,
            "lastHeartbeatTime": heartbeat, "lastTransitionTime": since,
        }

    return [
        cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory"),
        cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
        cond("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
        cond("Ready", "True", "KubeletReady", "e2e node agent is posting ready status"),
    ]


class NodeKeeper:
    """Registers the nodes, then keeps their leases and Ready heartbeats fresh."""

    def __init__(self, api: KubeAPI, specs: list[NodeSpec]) -> None:
        self.api = api
        self.specs = specs
        self.since = now()

    def _node(self, spec: NodeSpec) -> dict[str, Any]:
        capacity = {**_BASE_CAPACITY, **spec.capacity}
        labels = {
            "kubernetes.io/hostname": spec.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "wakegate.io/e2e-node": "true",
            **spec.labels,
        }
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": spec.name, "labels": labels},
            "spec": {"taints": copy.deepcopy(spec.taints)} if spec.taints else {},
            "status": {
                "capacity": capacity,
                "allocatable": dict(capacity),
                "conditions": _conditions(now(), self.since),
                "addresses": [
                    {"type": "InternalIP", "address": "127.0.0.1"},
                    {"type": "Hostname", "address": spec.name},
                ],
                # No kubelet API behind it: `kubectl logs/exec` will not work.
                "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
                "nodeInfo": {
                    "machineID": spec.name, "systemUUID": spec.name, "bootID": self.since,
                    "kernelVersion": "e2e", "osImage": "wakegate e2e node agent",
                    "containerRuntimeVersion": "e2e://local-process", "kubeletVersion": KUBELET_VERSION,
                    "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64",
                },
            },
        }

    async def register(self) -> None:
        for spec in self.specs:
            body = self._node(spec)
            try:
                node = await self.api.create("/api/v1/nodes", body)
            except ApiError as exc:
                if exc.status != 409:
                    raise
                # Left over from an earlier agent on this cluster: take it over.
                await self.api.merge_patch(f"/api/v1/nodes/{spec.name}", {"metadata": body["metadata"]})
                node = await self.api.merge_patch(
                    f"/api/v1/nodes/{spec.name}/status", {"status": body["status"]}
                )
            await self._ensure_lease(spec.name, node["metadata"]["uid"])
            log.info("registered node %s", spec.name)

    async def _ensure_lease(self, name: str, uid: str) -> None:
        lease = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": name,
                "namespace": "kube-node-lease",
                # As the kubelet does: the lease goes away with its node.
                "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": name, "uid": uid}],
            },
            "spec": {"holderIdentity": name, "leaseDurationSeconds": LEASE_DURATION_SECONDS,
                     "renewTime": micro_now()},
        }
        try:
            await self.api.create("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", lease)
        except ApiError as exc:
            if exc.status != 409:
                raise
            await self._renew(name)

    async def _renew(self, name: str) -> None:
        await self.api.merge_patch(
            f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}",
            {"spec": {"renewTime": micro_now(), "holderIdentity": name}},
        )

    async def run(self) -> None:
        last_status = asyncio.get_running_loop().time()
        while True:
            await asyncio.sleep(LEASE_RENEW_SECONDS)
            due = asyncio.get_running_loop().time() - last_status >= STATUS_SECONDS
            for spec in self.specs:
                try:
                    await self._renew(spec.name)
                    if due:
                        await self.api.merge_patch(
                            f"/api/v1/nodes/{spec.name}/status",
                            {"status": {"conditions": _conditions(now(), self.since)}},
                        )
                except (ApiError, OSError) as exc:
                    # The apiserver may be restarting; the next round retries.
                    log.warning("heartbeat for %s failed: %s", spec.name, exc)
            if due:
                last_status = asyncio.get_running_loop().time()
