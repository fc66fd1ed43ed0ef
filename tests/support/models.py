"""Model manifests from compact per-model dicts, and the demand a gateway reports for those models.

Models built by `models()` live in namespace `ns` unless told otherwise, the namespace `demand()`
reports for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from wakegate.control.demand.book import DemandBook
from wakegate.control.k8s.names import API_VERSION
from wakegate.v1 import demand_pb2


class _Dumper(yaml.SafeDumper):
    """Writes a value shared by two documents out in each (no YAML anchors)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def document(kind: str, name: str, spec: Mapping[str, Any], namespace: str | None = None) -> dict[str, Any]:
    """One wakegate.io object (Model, LoRAAdapter, ...) as `manifest()` takes it."""
    metadata = {"name": name} if namespace is None else {"name": name, "namespace": namespace}
    return {"apiVersion": API_VERSION, "kind": kind, "metadata": metadata, "spec": dict(spec)}


def sim_runtime(name: str, lifecycle: Mapping[str, Any]) -> dict[str, Any]:
    """An InferenceRuntime of the simulator (its image, probe and port) with its own `lifecycle`."""
    return document(
        "InferenceRuntime",
        name,
        {
            "backend": "sim",
            "image": "ghcr.io/wakegate/sim:latest",
            "args": ["--served-model-name", "{served_name}"],
            "port": 8000,
            "readinessProbe": {"path": "/health", "periodSeconds": 1},
            "lifecycle": dict(lifecycle),
        },
    )


def manifest(*documents: Mapping[str, Any]) -> str:
    """`documents` as one multi-document YAML text."""
    return yaml.dump_all(documents, Dumper=_Dumper, sort_keys=False, explicit_start=True)


def models(specs: Mapping[str, Mapping[str, Any]], namespace: str | None = "ns") -> str:
    """A Model per name in `specs`, `backend: sim` unless its spec names another."""
    return manifest(*(document("Model", name, {"backend": "sim", **spec}, namespace) for name, spec in specs.items()))


def demand(
    book: DemandBook,
    sequence: int,
    now: float,
    queued: Mapping[str, int],
    *,
    leases: bool = False,
    failures_seen: int = 0,
) -> None:
    """Gateway `gw`'s report `sequence` at `now`: `queued` requests per model name of `ns`, with
    `leases` each also an activation lease begun when the gateway had seen `failures_seen` failed
    activations; the book must accept it."""
    report = demand_pb2.DemandReport(
        gateway_id="gw",
        instance="i",
        sequence=sequence,
        models=[
            demand_pb2.ModelDemand(model=f"ns/{name}", queued=n, leases=n if leases else 0, failures_seen=failures_seen)
            for name, n in queued.items()
        ],
    )
    accepted, why = book.apply(report, now)
    assert accepted, why
