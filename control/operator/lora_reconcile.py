"""The operator's LoRAAdapters: loading them into a base's running pods, the pods' gate, and each
adapter's status.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from wakegate.control.backends import BACKENDS
from wakegate.control.k8s import names
from wakegate.control.k8s.adapters import GATE_ADAPTERS, Selection, adapter_mount
from wakegate.control.k8s.client import Kube, KubeError
from wakegate.control.k8s.objects import (
    model_from_object,
    rfc3339_now,
)
from wakegate.control.operator.keys import ADAPTER_KEY
from wakegate.control.operator.lora_loading import RuntimeLoader, Wanted
from wakegate.control.operator.lora_status import (
    AdapterObserved,
    adapter_status,
    gate_open,
    ready_pods,
    started_with,
)
from wakegate.control.schema import LoRAAdapter, Model

#: Seconds before a base whose engine refused an adapter load is tried again.
ADAPTER_RETRY = 10.0

log = logging.getLogger("wakegate.operator")


class LoraReconcile:
    """The LoRAAdapter part of the `Reconciler` (controller.py, which holds the state)."""

    if TYPE_CHECKING:
        kube: Kube
        models: dict[str, dict[str, Any]]
        pods: dict[str, dict[str, dict[str, Any]]]
        adapters: dict[str, dict[str, dict[str, Any]]]
        lora_loader: RuntimeLoader
        _adapter_seen: dict[str, set[str]]
        _adapter_counts: dict[str, list[int]]

        def poke(self, key: str) -> None: ...
        def selection(self, namespace: str) -> Selection: ...
        async def _patch_status(self, kind: str, body: Mapping[str, Any], patch: Mapping[str, Any],
                                whole: Mapping[str, Any], current: Callable[[], dict[str, Any] | None]) -> None: ...

    def _poke_adapters_of(self, model_key: str) -> None:
        namespace, _, name = model_key.partition("/")
        for adapter_name, adapter in self.adapters.get(namespace, {}).items():
            if (adapter.get("spec") or {}).get("baseModel") == name:
                self.poke(ADAPTER_KEY + names.model_key(namespace, adapter_name))

    async def _load_adapters(self, key: str, model: Model, adapters: tuple[LoRAAdapter, ...]) -> None:
        """Load a run-time-loading base's adapters into the pods whose engine answers (and unload
        removed ones), then open those pods' readiness gate: a pod is routed only once its
        adapters are in (a refused load is retried, the base serves on without it)."""
        namespace = key.partition("/")[0]
        pods = list(self.pods.get(key, {}).values())
        wanted = [Wanted(a.name, a.served_name, adapter_mount(a, model.spec.backend).argument) for a in adapters]
        engines = ready_pods(pods, "ContainersReady")
        await self.lora_loader.sync(key, pods, wanted, engines)
        if any(f"{namespace}/{a.name}" in self.lora_loader.failures for a in adapters):
            asyncio.get_running_loop().call_later(ADAPTER_RETRY, self.poke, key)
        synced = self.lora_loader.synced(key)
        for pod in pods:
            gates = (pod.get("spec") or {}).get("readinessGates") or []
            gated = any(g.get("conditionType") == GATE_ADAPTERS for g in gates)
            up = pod["metadata"]["name"] in synced
            if gated and up != gate_open(pod, GATE_ADAPTERS):
                await self._set_gate(pod, up)

    async def _set_gate(self, pod: Mapping[str, Any], loaded: bool) -> None:
        """The pod condition of the adapters' readiness gate (server-side apply: only that entry)."""
        meta = pod["metadata"]
        condition = {"type": GATE_ADAPTERS, "status": "True" if loaded else "False",
                     "lastTransitionTime": rfc3339_now(), "reason": "AdaptersLoaded" if loaded else "EngineNotReady"}
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
                "status": {"conditions": [condition]}}
        try:
            await asyncio.to_thread(self.kube.apply_status, body, names.FIELD_MANAGER)
        except KubeError as exc:
            if exc.status != 404:
                raise

    async def _reconcile_adapter(self, key: str) -> None:
        """A LoRAAdapter's status: its base's pods that hold it, or why none does."""
        namespace, _, name = key.partition("/")
        body = self.adapters.get(namespace, {}).get(name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self._adapter_seen.pop(key, None)
            self._adapter_counts.pop(key, None)
            self.lora_loader.failures.pop(key, None)
            self.lora_loader.new_failures.pop(key, None)
            return
        base = str((body.get("spec") or {}).get("baseModel") or "")
        refused = self.selection(namespace).refused.get(name)
        pods = list(self.pods.get(names.model_key(namespace, base), {}).values())
        holders: dict[str, str] = {}
        at_start = False
        if refused is None:
            backend = BACKENDS[model_from_object(self.models[names.model_key(namespace, base)]).spec.backend]
            at_start = bool(backend.lora_arg)
            holders = started_with(pods, name) if at_start else self.lora_loader.holders(key)
        previous = body.get("status") or {}
        seen = self._adapter_seen.setdefault(key, set(previous.get("replicas") or []))
        counts = self._adapter_counts.setdefault(
            key, [int(previous.get("loads", 0) or 0), int(previous.get("failures", 0) or 0)]
        )
        counts[0] += len(set(holders) - seen)
        counts[1] += self.lora_loader.take_failures(key)
        seen.update(holders)
        observed = AdapterObserved(
            generation=int(body["metadata"].get("generation", 0)),
            base=base,
            refused=refused,
            holders=holders,
            ready_replicas=len(ready_pods(pods)),
            loads=counts[0],
            failures=counts[1],
            failure=self.lora_loader.failures.get(key),
            at_start=at_start,
        )
        status = adapter_status(observed, previous, rfc3339_now())
        if any(previous.get(k) != v for k, v in status.items()):
            await self._patch_status("LoRAAdapter", body, status, status,
                                     lambda: self.adapters.get(namespace, {}).get(name))

