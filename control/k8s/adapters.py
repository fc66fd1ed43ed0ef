"""Which LoRAAdapters a base Model serves on a cluster, and how a source reaches a pod's files.

The operator (which starts llama.cpp pods with `--lora FILE` per adapter and loads vLLM's through
its API) and the xDS feeder (which routes adapter names, llama.cpp's by id) must agree on the same
adapters in the same order, or a request would get another adapter's id. Both take it from
:func:`select`: a namespace's Models and LoRAAdapters (plain JSON) in, each base's adapters in id
order and each refused adapter's reason out. Ids follow creation (then name), so a new adapter
takes the next id and those already served keep theirs.

:func:`source_mount` is the one mapping of a `source` (file://, pvc://, oci://, hf://) to what a
pod reads (its argument, a volume and a mount), for a base's weights and an adapter's alike.
Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from pydantic import ValidationError

from wakegate.control.backends import BACKENDS
from wakegate.control.schema import LoRAAdapter, Model

#: Pod annotation: the LoRAAdapters a llama.cpp pod started with, in id order (comma-separated).
ANNOTATION_ADAPTERS = "wakegate.io/lora-adapters"
#: Where a pod sees the volume of an adapter's weights.
ADAPTERS_ROOT = "/models/lora"
#: Readiness gate of the pods of a base that loads adapters at run time (vLLM): the operator sets
#: this pod condition True once it has loaded the base's adapters into the engine, so no request
#: reaches a pod before its adapters do.
GATE_ADAPTERS = "wakegate.io/lora-adapters-loaded"

# Condition reasons of a LoRAAdapter that is not served (stable: `kubectl get lora` shows them).
BASE_NOT_FOUND = "BaseModelNotFound"
BASE_INVALID = "BaseModelInvalid"
BACKEND_CANNOT = "BackendCannotServeAdapters"
TOO_MANY = "MaxAdaptersExceeded"
NAME_CONFLICT = "NameConflict"
SOURCE_UNSUPPORTED = "SourceUnsupported"
INVALID_SPEC = "InvalidSpec"


class SourceUnsupported(ValueError):
    """A source a pod of this backend cannot read on a cluster; the message says what to use."""


@dataclass(frozen=True)
class Mounted:
    """What a pod reads for one source: the path (or name) the engine is given, and its volume."""

    argument: str
    volumes: tuple[dict[str, Any], ...] = ()
    mounts: tuple[dict[str, Any], ...] = ()


def source_mount(source: str, backend: str, volume: str, root: str) -> Mounted:
    """`source` as a pod of `backend` reads it, its volume named `volume`, mounted under `root`.

    file:// is the node's folder (hostPath) at `root/local`; pvc://CLAIM/PATH the claim at
    `root/CLAIM`; oci:// an image volume at `root`; hf:// is handed to the engine as the repository
    name (only engines that download it themselves: not those that load one file).
    """
    needs_file = BACKENDS[backend].needs_file
    scheme, _, rest = source.partition("://")
    if scheme == "hf":
        if needs_file:
            raise SourceUnsupported(
                f"backend {backend} loads one GGUF file; on a cluster give it with file:// (a path on the node), "
                "pvc:// or oci://"
            )
        return Mounted(rest)
    read_only = {"name": volume, "readOnly": True}
    if scheme == "file":
        path = PurePosixPath(rest)
        if not path.is_absolute():
            raise SourceUnsupported(f"{source}: a cluster needs an absolute file:// path on the node")
        mount = f"{root}/local"
        return Mounted(
            f"{mount}/{path.name}",
            ({"name": volume, "hostPath": {"path": str(path.parent), "type": "Directory"}},),
            ({**read_only, "mountPath": mount},),
        )
    if scheme == "pvc":
        claim, _, path_in_claim = rest.partition("/")
        mount = f"{root}/{claim}"
        return Mounted(
            f"{mount}/{path_in_claim}" if path_in_claim else mount,
            ({"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}},),
            ({**read_only, "mountPath": mount},),
        )
    return Mounted(
        root,
        ({"name": volume, "image": {"reference": rest, "pullPolicy": "IfNotPresent"}},),
        ({**read_only, "mountPath": root},),
    )


def adapter_mount(adapter: LoRAAdapter, backend: str) -> Mounted:
    """An adapter's weights in a base's pod. The volume is named after what it mounts, so adapters
    in one node folder (or claim) share one volume, and a new one there adds no volume."""
    probe = source_mount(adapter.spec.source, backend, "probe", ADAPTERS_ROOT)
    if not probe.volumes:
        return probe
    what = {k: v for k, v in probe.volumes[0].items() if k != "name"}
    tag = hashlib.blake2b(json.dumps(what, sort_keys=True).encode(), digest_size=5).hexdigest()
    name = f"lora-{tag}"
    if BACKENDS[backend].needs_file and "image" in what:
        raise SourceUnsupported(
            f"backend {backend} loads one adapter file; an oci:// adapter mounts as a folder on a cluster: "
            "give it with file:// (a path on the node) or pvc://CLAIM/FILE"
        )
    return source_mount(adapter.spec.source, backend, name, f"{ADAPTERS_ROOT}/{tag}")


@dataclass(frozen=True)
class Refused:
    """Why a LoRAAdapter is not served: a condition reason and a message for people."""

    reason: str
    message: str


@dataclass(frozen=True)
class Selection:
    """A namespace's adapters: those each base serves, in id order, and why the others are not."""

    served: dict[str, tuple[LoRAAdapter, ...]] = field(default_factory=dict)
    refused: dict[str, Refused] = field(default_factory=dict)

    def of(self, base: str) -> tuple[LoRAAdapter, ...]:
        return self.served.get(base, ())


def _order(body: Mapping[str, Any]) -> tuple[str, str]:
    meta = body.get("metadata") or {}
    return str(meta.get("creationTimestamp") or ""), str(meta.get("name") or "")


def _problems(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())


def select(models: Mapping[str, Model | None], adapters: Iterable[Mapping[str, Any]]) -> Selection:
    """Each base's adapters from a namespace's Models (by name; None: one that does not parse)
    and LoRAAdapter objects. An adapter is served when its base exists and its backend takes
    adapters, its source reaches that backend's pods, its names are free, and it is among the
    first `spec.adapters.maxAdapters` of its base (every replica holds all of them)."""
    served: dict[str, list[LoRAAdapter]] = {}
    refused: dict[str, Refused] = {}
    taken: dict[str, set[str]] = {}
    for body in sorted(adapters, key=_order):
        name = str((body.get("metadata") or {}).get("name"))
        try:
            adapter = LoRAAdapter.model_validate(
                {"metadata": body.get("metadata") or {}, "spec": body.get("spec") or {}}
            )
        except ValidationError as exc:
            refused[name] = Refused(INVALID_SPEC, _problems(exc))
            continue
        base_name = adapter.spec.baseModel
        if base_name not in models:
            refused[name] = Refused(BASE_NOT_FOUND, f"no Model {base_name!r} in this namespace")
            continue
        base = models[base_name]
        if base is None:
            refused[name] = Refused(BASE_INVALID, f"Model {base_name!r} has an invalid spec")
            continue
        backend = BACKENDS[base.spec.backend]
        if not backend.serves_adapters:
            refused[name] = Refused(BACKEND_CANNOT, f"backend {backend.name} of Model {base_name!r} cannot load "
                                                    "LoRAAdapters")
            continue
        try:
            adapter_mount(adapter, base.spec.backend)
        except SourceUnsupported as exc:
            refused[name] = Refused(SOURCE_UNSUPPORTED, str(exc))
            continue
        names = taken.setdefault(base_name, set(base.client_names) | set(base.spec.loraAdapters))
        clash = next((n for n in adapter.client_names if n in names), None)
        if clash is not None:
            refused[name] = Refused(NAME_CONFLICT, f"name {clash!r} is already used by Model {base_name!r} or "
                                                   "another of its adapters")
            continue
        own = served.setdefault(base_name, [])
        cap = base.spec.adapters.maxAdapters
        if len(own) >= cap:
            refused[name] = Refused(TOO_MANY, f"Model {base_name!r} already serves spec.adapters.maxAdapters "
                                              f"({cap}) adapters; each replica holds every adapter of its base")
            continue
        own.append(adapter)
        names.update(adapter.client_names)
    return Selection({k: tuple(v) for k, v in served.items()}, refused)
