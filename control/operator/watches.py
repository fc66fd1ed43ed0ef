"""What the operator watches: its Kopf handlers, each recording the object and poking the
Reconciler, and whether KEDA's ScaledObject kind exists.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import kopf

from wakegate.control.k8s import names
from wakegate.control.k8s.client import Kube, path
from wakegate.control.operator.controller import BACKEND_LABELS, SCALEDOBJECT_CRD, Reconciler


def _forward(record: Callable[[str | None, Mapping[str, Any]], None]) -> Callable[..., Awaitable[None]]:
    """A Kopf event handler handing the event's type and object to `record`."""

    async def handler(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        record(event.get("type"), body)

    return handler


def register(registry: kopf.OperatorRegistry, reconciler: Reconciler) -> None:
    """Kopf handlers: record the object, enqueue the Model it belongs to. Nothing is written here."""
    ours = (names.GROUP, names.VERSION)
    #: handler id, (group, version, plural), the Reconciler method it calls, Kopf's filters
    watched: list[tuple[str, tuple[str, str, str], str, dict[str, Any]]] = [
        ("model", (*ours, names.MODEL_PLURAL), "on_model", {}),
        ("runtime", (*ours, names.RUNTIME_PLURAL), "on_runtime", {}),
        ("cache", (*ours, names.MODELCACHE_PLURAL), "on_cache", {}),
        ("catalog", (*ours, names.MODELCATALOG_PLURAL), "on_catalog", {}),
        ("adapter", (*ours, names.LORAADAPTER_PLURAL), "on_adapter", {}),
        ("deployment", ("apps", "v1", "deployments"), "on_deployment", {"labels": BACKEND_LABELS}),
        ("pod", ("", "v1", "pods"), "on_pod", {"labels": BACKEND_LABELS}),
    ]
    for name, (group, version, plural), method, filters in watched:

        def record(event_type: str | None, body: Mapping[str, Any], method: str = method) -> None:
            getattr(reconciler, method)(event_type, body)

        kopf.on.event(group, version, plural, id=f"{name}_event", registry=registry, **filters)(_forward(record))

    def keda_crd(event_type: str | None, _body: Mapping[str, Any]) -> None:
        reconciler.on_keda_crd(event_type != "DELETED")

    kopf.on.event(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        id="crd_event",
        when=lambda name, **_: name == SCALEDOBJECT_CRD,
        registry=registry,
    )(_forward(keda_crd))


def keda_installed(kube: Kube) -> bool:
    crd = kube.get_or_none(path("apiextensions.k8s.io/v1", "CustomResourceDefinition", None, SCALEDOBJECT_CRD))
    return crd is not None
