"""Typed objects from Kubernetes JSON: the one way a Model, an InferenceRuntime or a ModelCache is read from a cluster.

Whoever reads a Model from the API server (the operator, the xDS feeder, the scaler) gets it
here, with one set of defaults: `status` and the server's metadata bookkeeping (uid,
managed fields and the like) are dropped, a missing `metadata` or `spec` counts as empty, and anything else the
schema does not accept raises `pydantic.ValidationError`. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, TypeVar

from wakegate.control.delivery_schema import ModelCache, ModelCatalog
from wakegate.control.runtime_schema import InferenceRuntime
from wakegate.control.schema import Model

_T = TypeVar("_T", Model, InferenceRuntime, ModelCache, ModelCatalog)


def _typed(kind: type[_T], body: Mapping[str, Any]) -> _T:
    # Metadata keeps what the schema knows (name, namespace, labels) and ignores the rest.
    return kind.model_validate(
        {
            "apiVersion": body.get("apiVersion"),
            "kind": body.get("kind"),
            "metadata": body.get("metadata") or {},
            "spec": body.get("spec") or {},
        }
    )


def model_from_object(body: Mapping[str, Any]) -> Model:
    return _typed(Model, body)


def runtime_from_object(body: Mapping[str, Any]) -> InferenceRuntime:
    return _typed(InferenceRuntime, body)


def modelcache_from_object(body: Mapping[str, Any]) -> ModelCache:
    return _typed(ModelCache, body)


def modelcatalog_from_object(body: Mapping[str, Any]) -> ModelCatalog:
    return _typed(ModelCatalog, body)


def rfc3339_now() -> str:
    """Now, as Kubernetes writes a time in a status (RFC 3339, UTC, whole seconds)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
