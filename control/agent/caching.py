"""What the node agent decides about ModelCaches and writes for them. Pure: no I/O.

- `wants`: whether a ModelCache wants its sources on this node (its node selector, and with
  `modelRef` every node that Model may run on: the Model's node selector, and for a GPU Model a
  node the agent labelled with the Model's GPU vendor and one of its architectures).
- `Entry` / `status_body`: this node's entries of a ModelCache's `status.nodes`, as one
  server-side apply body. Entries are keyed by (node, source) in the CRD, and each agent applies
  with its own field manager, so an agent only ever replaces its own node's entries.
- `label_patch`: the Node labels `cache.wakegate.io/sha256-…` naming what the node's cache holds
  ready, for the operator (pods go only where the weights are) and the scheduler extender (scores).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from wakegate.control.delivery_schema import ModelCache
from wakegate.control.k8s import names
from wakegate.control.schema import Model


class EntryPhase(StrEnum):
    PENDING = "Pending"
    PULLING = "Pulling"
    READY = "Ready"
    FAILED = "Failed"


def _selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def model_may_run(model: Model, labels: Mapping[str, str]) -> bool:
    """Whether a pod of `model` could be placed on a node with these labels, as far as labels tell."""
    if not _selects(model.spec.nodeSelector, labels):
        return False
    gpu = model.spec.resources.gpu
    if gpu.count == 0:
        return True
    vendor = labels.get(names.NODE_GPU_VENDOR)
    if vendor is None or (gpu.vendor is not None and vendor != gpu.vendor):
        return False
    return not gpu.arch or labels.get(names.NODE_GPU_ARCH) in gpu.arch


def wants(cache: ModelCache, labels: Mapping[str, str], models: Mapping[str, Model]) -> bool:
    """Whether `cache` wants its sources on the node with these labels; `models` by name, same namespace."""
    if not _selects(cache.spec.nodeSelector, labels):
        return False
    if cache.spec.modelRef is None:
        return True
    model = models.get(cache.spec.modelRef.name)
    return model is not None and model_may_run(model, labels)


@dataclass(frozen=True)
class Entry:
    """One source of one ModelCache on this node, as its status entry shows it."""

    phase: EntryPhase
    done: int = 0
    total: int | None = None
    digest: str | None = None
    size: int | None = None
    #: the weight file inside the entry's `files/` (for engines that load one file)
    file: str | None = None
    ready_time: str | None = None
    reason: str | None = None
    message: str | None = None

    def status(self, node: str, source: str) -> dict[str, Any]:
        out: dict[str, Any] = {"node": node, "source": source, "phase": self.phase.value}
        if self.phase is EntryPhase.PULLING:
            out["bytesDone"] = self.done
            if self.total is not None:
                out["bytesTotal"] = self.total
        optional = {
            "digest": self.digest,
            "size": self.size,
            "file": self.file,
            "readyTime": self.ready_time,
            "reason": self.reason,
            "message": self.message,
        }
        out.update({k: v for k, v in optional.items() if v is not None})
        return out


def status_body(namespace: str, name: str, node: str, entries: Mapping[str, Entry]) -> dict[str, Any]:
    """The apply body for this node's entries (source -> entry) of one ModelCache; empty entries
    release every entry this node wrote before."""
    return {
        "apiVersion": names.API_VERSION,
        "kind": "ModelCache",
        "metadata": {"name": name, "namespace": namespace},
        "status": {"nodes": [entry.status(node, source) for source, entry in sorted(entries.items())]},
    }


def label_patch(held: Iterable[str], labels: Mapping[str, str]) -> dict[str, Any] | None:
    """The merge patch from the node's cache labels to the keys its cache holds ready; None: nothing to do."""
    want = {names.cache_label(key) for key in held}
    have = {key for key in labels if key.startswith(names.NODE_CACHE_PREFIX)}
    changes: dict[str, str | None] = {key: "ready" for key in sorted(want - have)}
    changes.update({key: None for key in sorted(have - want)})
    return {"metadata": {"labels": changes}} if changes else None
