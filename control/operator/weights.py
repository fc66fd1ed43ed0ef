"""Pure: where a Model's weights stand in the node caches, from the ModelCaches' status.

For `spec.cache.strategy` `node` and `prewarm` the operator renders the backend only once the
weights are Ready in some node's cache, and then only for nodes that hold them (see render.py).
`weights_for` reads the ModelCaches of the Model's namespace that name the Model (`modelRef`)
or its source, and answers with the state, the entry to mount (digest and file), the
conditions `WeightsPulling` and `PrewarmFailed`, and the ModelCache the operator keeps for the
Model when it needs one: for `prewarm` when no other ModelCache names the Model, for `node`
when no other ModelCache has its source (so the weights are always asked for). `cache_summary` is the ModelCache's own
summary status (ready nodes over wanted nodes, a Ready condition), from its per-node entries.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from wakegate.control.delivery.progress import human_bytes
from wakegate.control.delivery_schema import CACHED_SCHEMES
from wakegate.control.k8s import names
from wakegate.control.operator.pinning import same_weights, tag_of
from wakegate.control.operator.render import Condition, owner_reference
from wakegate.control.schema import CacheStrategy, Model


class State(StrEnum):
    READY = "ready"
    PULLING = "pulling"
    PENDING = "pending"
    FAILED = "failed"


@dataclass(frozen=True)
class Weights:
    state: State
    #: the cache entry pods mount (READY only)
    digest: str | None = None
    file: str | None = None
    ready_nodes: tuple[str, ...] = ()
    message: str = ""
    reason: str = ""
    conditions: tuple[Condition, ...] = ()
    #: the ModelCache to apply for a `prewarm` Model no other ModelCache names
    owned_cache: dict[str, Any] | None = field(default=None, compare=False)


def _entries(cache: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [e for e in ((cache.get("status") or {}).get("nodes") or []) if isinstance(e, Mapping)]


def _owned_by(cache: Mapping[str, Any], uid: str | None) -> bool:
    refs = (cache.get("metadata") or {}).get("ownerReferences") or []
    return uid is not None and any(ref.get("uid") == uid for ref in refs)


def owned_cache(body: Mapping[str, Any], model: Model) -> dict[str, Any]:
    meta = body["metadata"]
    return {
        "apiVersion": names.API_VERSION,
        "kind": "ModelCache",
        "metadata": {
            "name": names.owned_cache_name(model.name),
            "namespace": meta["namespace"],
            "labels": names.backend_labels(model.name),
            "ownerReferences": [owner_reference(body)],
        },
        "spec": {"sources": [model.spec.source], "modelRef": {"name": model.name}},
    }


def weights_for(body: Mapping[str, Any], model: Model, caches: Iterable[Mapping[str, Any]]) -> Weights | None:
    """None for `strategy: none` (the engine reads the source itself); `caches` are the
    ModelCache objects of the Model's namespace."""
    strategy = model.spec.cache.strategy
    source = model.spec.source
    if strategy is CacheStrategy.NONE or source is None:
        return None
    if source.partition("://")[0] not in CACHED_SCHEMES:
        message = (f"cache strategy {strategy.value} needs an oci:// or hf:// source; {source} is read in place "
                   "(use strategy none)")
        failed = Condition("PrewarmFailed", "True", "bad_source", message)
        return Weights(State.FAILED, message=message, reason="bad_source",
                       conditions=(Condition("WeightsPulling", "False", "bad_source", message), failed))
    uid = (body.get("metadata") or {}).get("uid")
    # A source the operator pinned (`pinning`) is also held by a ModelCache naming its tag.
    unpinned = tag_of(source)
    relevant = []
    named = covered = False
    for cache in caches:
        spec = cache.get("spec") or {}
        names_model = (spec.get("modelRef") or {}).get("name") == model.name
        has_source = any(s in (source, unpinned) for s in spec.get("sources") or [])
        if names_model or has_source:
            relevant.append(cache)
        if not _owned_by(cache, uid):
            named = named or names_model
            covered = covered or names_model or has_source
    # prewarm: unless a ModelCache names the Model; node: unless any ModelCache has its weights.
    wants_own = not named if strategy is CacheStrategy.PREWARM else not covered
    own = owned_cache(body, model) if wants_own else None
    entries = [
        e for cache in relevant for e in _entries(cache) if same_weights(str(e.get("source")), e.get("digest"), source)
    ]
    return replace(_state(entries), owned_cache=own)


def _state(entries: list[Mapping[str, Any]]) -> Weights:
    ready = [e for e in entries if e.get("phase") == "Ready" and e.get("digest")]
    failed = sorted((e for e in entries if e.get("phase") == "Failed"), key=lambda e: str(e.get("node")))
    pulling = [e for e in entries if e.get("phase") == "Pulling"]
    nodes = sorted({str(e.get("node")) for e in entries})
    prewarm_failed = Condition("PrewarmFailed", "False", "NoFailures")
    if failed:
        first = failed[0]
        reason = str(first.get("reason") or "failed")
        message = f"node {first.get('node')}: {first.get('message') or reason}"
        if len(failed) > 1:
            message += f" (and {len(failed) - 1} more node(s))"
        prewarm_failed = Condition("PrewarmFailed", "True", reason, message)
    if ready:
        newest = max(ready, key=lambda e: (str(e.get("readyTime") or ""), str(e.get("digest"))))
        digest = str(newest["digest"])
        holders = tuple(sorted({str(e.get("node")) for e in ready if e.get("digest") == digest}))
        message = f"weights {digest} ready on {len(holders)}/{len(nodes)} node(s): {', '.join(holders)}"
        return Weights(State.READY, digest, newest.get("file"), holders, message, "WeightsReady",
                       (Condition("WeightsPulling", "False", "WeightsReady", message), prewarm_failed))
    if failed and not pulling and len(failed) == len(nodes):
        reason, message = prewarm_failed.reason, prewarm_failed.message
        return Weights(State.FAILED, message=message, reason=reason,
                       conditions=(Condition("WeightsPulling", "False", reason, message), prewarm_failed))
    if pulling:
        done = sum(int(e.get("bytesDone") or 0) for e in pulling)
        total = sum(int(e.get("bytesTotal") or 0) for e in pulling)
        message = f"pulling on {len(pulling)} node(s): {human_bytes(done)}"
        message += f" / {human_bytes(total)}" if total else ""
        state, reason = State.PULLING, "Pulling"
    elif entries:
        state, reason = State.PENDING, "Pending"
        message = f"{len(nodes)} node(s) are to pull the weights"
    else:
        state, reason = State.PENDING, "WaitingForNodes"
        message = "no node reports the weights yet (a node agent with a cache must run where the Model may run)"
    return Weights(state, message=message, reason=reason,
                   conditions=(Condition("WeightsPulling", "True", reason, message), prewarm_failed))


def cache_summary(
    cache: Mapping[str, Any], previous: Mapping[str, Any], now: str, invalid: str | None = None
) -> dict[str, Any]:
    """The operator's part of a ModelCache's status: ready/wanted nodes and a Ready condition.

    A node is ready when every source of the ModelCache is Ready there; `invalid` says why the
    spec cannot be used (no agent acts on it then). Conditions keep their `lastTransitionTime`
    while their status holds, so an unchanged world writes nothing.
    """
    sources = list((cache.get("spec") or {}).get("sources") or [])
    by_node: dict[str, dict[str, Mapping[str, Any]]] = {}
    for entry in _entries(cache):
        by_node.setdefault(str(entry.get("node")), {})[str(entry.get("source"))] = entry
    ready = sorted(n for n, got in by_node.items() if all((got.get(s) or {}).get("phase") == "Ready" for s in sources))
    failed = [(n, e) for n, got in sorted(by_node.items()) for e in got.values() if e.get("phase") == "Failed"]
    wanted = len(by_node)
    if invalid is not None:
        cond = Condition("Ready", "False", "InvalidSpec", invalid)
    elif failed:
        node, entry = failed[0]
        reason = str(entry.get("reason") or "failed")
        cond = Condition("Ready", "False", reason, f"node {node}: {entry.get('message', '')}")
    elif wanted == 0:
        cond = Condition("Ready", "False", "NoNodes", "no node agent with a cache wants these sources (yet)")
    elif len(ready) == wanted:
        cond = Condition("Ready", "True", "Ready", f"ready on {wanted} node(s)")
    else:
        cond = Condition("Ready", "False", "Pulling", f"ready on {len(ready)} of {wanted} node(s)")
    generation = int((cache.get("metadata") or {}).get("generation", 0) or 0)
    return {
        "readyNodes": len(ready),
        "wantedNodes": wanted,
        "ready": f"{len(ready)}/{wanted}",
        "observedGeneration": generation,
        "conditions": [condition_dict(cond, previous, now, generation)],
    }


def condition_dict(cond: Condition, previous: Mapping[str, Any], now: str, generation: int) -> dict[str, Any]:
    """A status condition; `lastTransitionTime` from `previous` status while the status holds."""
    old: Mapping[str, Any] = next((c for c in previous.get("conditions") or [] if c.get("type") == cond.type), {})
    since = old.get("lastTransitionTime") if old.get("status") == cond.status else None
    return {
        "type": cond.type,
        "status": cond.status,
        "reason": cond.reason,
        "message": cond.message,
        "lastTransitionTime": since or now,
        "observedGeneration": generation,
    }
