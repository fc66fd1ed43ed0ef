"""What the operator watches: its Kopf handlers, each recording the object and poking the
Reconciler, and whether KEDA's ScaledObject kind exists.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf

from wakegate.control.k8s import names
from wakegate.control.k8s.client import Kube, path
from wakegate.control.operator.controller import BACKEND_LABELS, SCALEDOBJECT_CRD, Reconciler


def register(registry: kopf.OperatorRegistry, reconciler: Reconciler) -> None:
    """Kopf handlers: record the object, enqueue the Model it belongs to. Nothing is written here."""

    async def model_event(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        reconciler.on_model(event.get("type"), body)

    async def runtime_event(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        reconciler.on_runtime(event.get("type"), body)

    async def deployment_event(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        reconciler.on_deployment(event.get("type"), body)

    async def pod_event(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        reconciler.on_pod(event.get("type"), body)

    async def cache_event(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        reconciler.on_cache(event.get("type"), body)

    async def catalog_event(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        reconciler.on_catalog(event.get("type"), body)

    async def adapter_event(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        reconciler.on_adapter(event.get("type"), body)

    async def crd_event(event: Mapping[str, Any], **_: Any) -> None:
        reconciler.on_keda_crd(event.get("type") != "DELETED")

    on_event = kopf.on.event
    on_event(names.GROUP, names.VERSION, names.MODEL_PLURAL, registry=registry)(model_event)
    on_event(names.GROUP, names.VERSION, names.RUNTIME_PLURAL, registry=registry)(runtime_event)
    on_event(names.GROUP, names.VERSION, names.MODELCACHE_PLURAL, registry=registry)(cache_event)
    on_event(names.GROUP, names.VERSION, names.MODELCATALOG_PLURAL, registry=registry)(catalog_event)
    on_event(names.GROUP, names.VERSION, names.LORAADAPTER_PLURAL, registry=registry)(adapter_event)
    on_event("apps", "v1", "deployments", labels=BACKEND_LABELS, registry=registry)(deployment_event)
    on_event("", "v1", "pods", labels=BACKEND_LABELS, registry=registry)(pod_event)
    on_event(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        when=lambda name, **_: name == SCALEDOBJECT_CRD,
        registry=registry,
    )(crd_event)


def keda_installed(kube: Kube) -> bool:
    crd = kube.get_or_none(path("apiextensions.k8s.io/v1", "CustomResourceDefinition", None, SCALEDOBJECT_CRD))
    return crd is not None
