"""Kubernetes as the feeder's source of truth: Models and backend EndpointSlices -> `RoutedModel`s.

Pure bookkeeping, no I/O: `KubeSource` records watch events (plain dicts) and
says what is routable. Endpoints are the ready addresses of the EndpointSlices
of a Model's backend Service (they carry the backend labels, copied from the
Service), with the slice's `http` port. `admitted` comes from the Model's
status (the operator sets it False for a GPU-group member that must wait);
`failed_activations` counts the times the Model entered phase Failed, so held
cold requests fail at once instead of waiting for their activation timeout.

Endpoints on a node that is leaving (cordoned or drained, marked for deletion by the cluster
autoscaler or Karpenter, or about to be reclaimed as a spot/preemptible machine: `node_leaving`)
leave the routes as soon as the Node says so, before the kubelet stops the pod, as long as the
Model keeps an endpoint elsewhere: when every endpoint is on leaving nodes they stay routed (a
draining replica serves better than none while its replacement starts).

A base's LoRAAdapters (of its namespace, chosen and ordered by `k8s.adapters.select`, as the
operator starts llama.cpp pods with them) travel in its route: their names resolve to the base,
llama.cpp's with their `--lora` id and scale. Refused adapters are not routed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from wakegate.control.feeder.routed import RoutedModel, routed_model
from wakegate.control.k8s import names
from wakegate.control.k8s.adapters import select
from wakegate.control.k8s.objects import model_from_object
from wakegate.control.schema import Model

#: Taints that say a node is about to go away (NoSchedule or NoExecute, any value).
LEAVING_TAINTS = frozenset(
    {
        "node.kubernetes.io/unschedulable",  # cordoned (kubectl drain, node upgrades)
        "node.kubernetes.io/out-of-service",  # shut down, its pods about to be force-deleted
        "node.cloudprovider.kubernetes.io/shutdown",
        "ToBeDeletedByClusterAutoscaler",  # the cluster autoscaler's scale-down
        "karpenter.sh/disrupted",  # Karpenter v1 consolidation, expiry, interruption
        "karpenter.sh/disruption",  # Karpenter before v1
        "cloud.google.com/impending-node-termination",  # GKE spot/preemptible reclaim
        "aws-node-termination-handler/spot-itn",  # AWS spot interruption notice
        "aws-node-termination-handler/rebalance-recommendation",
        "aws-node-termination-handler/scheduled-maintenance",
        "aws-node-termination-handler/asg-lifecycle-termination",
    }
)
#: Node conditions (status True) that announce a termination (AKS node-problem-detector's
#: scheduled events for spot eviction and VM deletion).
LEAVING_CONDITIONS = frozenset({"PreemptScheduled", "TerminateScheduled"})


def node_leaving(body: Mapping[str, Any]) -> bool:
    """Whether a Node is cordoned, draining, being deleted or about to be reclaimed."""
    spec = body.get("spec") or {}
    if spec.get("unschedulable") is True or (body.get("metadata") or {}).get("deletionTimestamp"):
        return True
    if any(
        t.get("key") in LEAVING_TAINTS and t.get("effect") in ("NoSchedule", "NoExecute")
        for t in spec.get("taints") or []
    ):
        return True
    conditions = (body.get("status") or {}).get("conditions") or []
    return any(c.get("type") in LEAVING_CONDITIONS and c.get("status") == "True" for c in conditions)


def slice_endpoints(body: Mapping[str, Any]) -> set[tuple[str, int]]:
    """Ready (ip, port) pairs of one EndpointSlice; `ready` absent means ready, as the API defines."""
    return set(slice_nodes(body))


def slice_nodes(body: Mapping[str, Any]) -> dict[tuple[str, int], str | None]:
    """Ready (ip, port) pairs of one EndpointSlice and the node each is on (None: not said)."""
    ports = [p for p in body.get("ports") or [] if p.get("port")]
    http = next((p for p in ports if p.get("name") == "http"), ports[0] if ports else None)
    if http is None:
        return {}
    out: dict[tuple[str, int], str | None] = {}
    for endpoint in body.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        if conditions.get("ready") is False or conditions.get("terminating") is True:
            continue
        node = endpoint.get("nodeName")
        for address in endpoint.get("addresses") or []:
            out[(str(address), int(http["port"]))] = str(node) if node else None
    return out


@dataclass(frozen=True)
class Listed:
    """What a plain list of the cluster found: Model keys, (model key, EndpointSlice name) of the
    model backends' slices, (namespace, name) of LoRAAdapters."""

    models: frozenset[str]
    slices: frozenset[tuple[str, str]]
    adapters: frozenset[tuple[str, str]]

    @classmethod
    def of(
        cls,
        models: Iterable[Mapping[str, Any]],
        slices: Iterable[Mapping[str, Any]],
        adapters: Iterable[Mapping[str, Any]],
    ) -> Listed:
        slice_keys = ((names.owning_model_key(s["metadata"]), s["metadata"]["name"]) for s in slices)
        return cls(
            models=frozenset(names.model_key(m["metadata"]["namespace"], m["metadata"]["name"]) for m in models),
            slices=frozenset((key, name) for key, name in slice_keys if key is not None),
            adapters=frozenset((a["metadata"]["namespace"], a["metadata"]["name"]) for a in adapters),
        )


@dataclass
class KubeSource:
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: model key -> slice name -> ready endpoint -> its node
    slices: dict[str, dict[str, dict[tuple[str, int], str | None]]] = field(default_factory=dict)
    #: Nodes that are leaving (`node_leaving`), by name.
    leaving: set[str] = field(default_factory=set)
    failures: dict[str, int] = field(default_factory=dict)
    failed_now: dict[str, bool] = field(default_factory=dict)
    #: LoRAAdapters by namespace, then name (spec and metadata only)
    adapters: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    #: model key -> its manifest parsed (None: invalid), and its last RoutedModel; rebuilt only for
    #: the keys an event touched (`_dirty`; None: all), so a change costs one Model, not all.
    _parsed: dict[str, Model | None] = field(default_factory=dict)
    _routed: dict[str, RoutedModel] = field(default_factory=dict)
    _dirty: set[str] | None = field(default_factory=set)
    #: model key -> what its parsed manifest was made of (uid, generation, labels)
    _made_of: dict[str, tuple[Any, ...]] = field(default_factory=dict)

    def _touch(self, key: str) -> None:
        if self._dirty is not None:
            self._dirty.add(key)

    def _touch_namespace(self, namespace: str) -> None:
        for key in self.models:
            if key.partition("/")[0] == namespace:
                self._touch(key)

    def on_model(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        meta = body["metadata"]
        key = names.model_key(meta["namespace"], meta["name"])
        made_of = (meta.get("uid"), meta.get("generation") or meta.get("resourceVersion"), meta.get("labels"))
        if self._made_of.get(key) != made_of:
            # The spec or labels moved (status writes leave the parsed manifest as it is).
            self._parsed.pop(key, None)
            self._made_of[key] = made_of
        self._touch(key)
        if self.adapters.get(str(meta["namespace"])):
            # Adapters are chosen per namespace among its Models: its other Models may change too.
            self._touch_namespace(str(meta["namespace"]))
        if event_type == "DELETED":
            self.models.pop(key, None)
            self.failures.pop(key, None)
            self.failed_now.pop(key, None)
            return
        self.models[key] = {k: body.get(k) for k in ("apiVersion", "kind", "metadata", "spec", "status")}
        failed = ((body.get("status") or {}).get("phase")) == "Failed"
        if failed and not self.failed_now.get(key, False):
            self.failures[key] = self.failures.get(key, 0) + 1
        self.failed_now[key] = failed

    def on_adapter(self, event_type: str | None, body: Mapping[str, Any]) -> bool:
        """Record a LoRAAdapter; True when what routes could see of it changed (not a status write)."""
        meta = body["metadata"]
        store = self.adapters.setdefault(meta["namespace"], {})
        old = store.get(meta["name"])
        if event_type == "DELETED":
            store.pop(meta["name"], None)
            changed = old is not None
        else:
            new = {k: body.get(k) for k in ("metadata", "spec")}
            store[meta["name"]] = new
            changed = old is None or (old["metadata"].get("generation"), old["spec"]) != (
                meta.get("generation"),
                new["spec"],
            )
        if changed:
            self._touch_namespace(str(meta["namespace"]))
        return changed

    def holds(self, listed: Listed) -> bool:
        """Whether the watches delivered at least everything `listed` names."""
        return (
            listed.models <= self.models.keys()
            and all(name in self.slices.get(key, {}) for key, name in listed.slices)
            and all(name in self.adapters.get(namespace, {}) for namespace, name in listed.adapters)
        )

    def on_slice(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        meta = body["metadata"]
        key = names.owning_model_key(meta)
        if key is None:
            return
        self._touch(key)
        by_slice = self.slices.setdefault(key, {})
        if event_type == "DELETED":
            by_slice.pop(meta["name"], None)
        else:
            by_slice[meta["name"]] = slice_nodes(body)

    def on_node(self, event_type: str | None, body: Mapping[str, Any]) -> bool:
        """Record a Node's state; True when whether it is leaving changed (routes may change)."""
        name = str(body["metadata"]["name"])
        was = name in self.leaving
        if event_type != "DELETED" and node_leaving(body):
            self.leaving.add(name)
        else:
            self.leaving.discard(name)
        if was != (name in self.leaving):
            self._dirty = None  # which Models have endpoints there is not indexed: all, rarely
            return True
        return False

    def endpoints(self, key: str) -> set[tuple[str, int]]:
        """A Model's routable endpoints: those on nodes staying, or all when none is."""
        found: dict[tuple[str, int], str | None] = {}
        for by_endpoint in self.slices.get(key, {}).values():
            found.update(by_endpoint)
        staying = {e for e, node in found.items() if node is None or node not in self.leaving}
        return staying or set(found)

    def routed(self) -> list[RoutedModel]:
        """Every valid Model's RoutedModel, in key order; only the Models touched since the last
        call are parsed and built again (the others are the same objects as last time)."""
        dirty = set(self.models) if self._dirty is None else self._dirty & self.models.keys()
        self._dirty = set()
        for key in [k for k in self._routed if k not in self.models]:
            del self._routed[key]
        for key in [k for k in self._parsed if k not in self.models]:
            del self._parsed[key]
            self._made_of.pop(key, None)
        if dirty:
            self._rebuild(dirty)
        return [self._routed[key] for key in sorted(self._routed)]

    def _model(self, key: str) -> Model | None:
        if key not in self._parsed:
            try:
                self._parsed[key] = model_from_object(self.models[key])
            except ValidationError:
                self._parsed[key] = None
        return self._parsed[key]

    def _rebuild(self, dirty: set[str]) -> None:
        selections = {}
        for namespace in {key.partition("/")[0] for key in dirty}:
            bodies = self.adapters.get(namespace)
            if bodies:
                members = {k.partition("/")[2]: self._model(k) for k in self.models if k.partition("/")[0] == namespace}
                selections[namespace] = select(members, bodies.values())
        for key in dirty:
            body = self.models[key]
            model = self._model(key)
            if model is None:
                self._routed.pop(key, None)
                continue
            selection = selections.get(key.partition("/")[0])
            if selection is not None and selection.of(model.name):
                model = model.with_adapters(selection.of(model.name))
            status = body.get("status") or {}
            failed = self.failed_now.get(key, False)
            ready_message = next(
                (c.get("message", "") for c in status.get("conditions") or [] if c.get("type") == "Ready"), ""
            )
            routed = routed_model(
                model,
                self.endpoints(key),
                generation=int(body["metadata"].get("generation", 0)),
                failed_activations=self.failures.get(key, 0),
                last_failure=str(ready_message) if failed else "",
                admitted=bool(status.get("admitted", True)),
            )
            old = self._routed.get(key)
            self._routed[key] = old if old == routed else routed
