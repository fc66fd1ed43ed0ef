"""The operator's Kopf handlers: each watched kind reaches its Reconciler method with the event's
type and object; the ScaledObject CRD's presence follows its events."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf

from wakegate.control.operator import watches
from wakegate.control.operator.controller import BACKEND_LABELS, SCALEDOBJECT_CRD


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, Any]] = []

    def __getattr__(self, method: str) -> Any:
        return lambda *args: self.calls.append((method, *args) if len(args) == 2 else (method, args[0], None))


def handlers() -> tuple[Recorder, dict[str, Any]]:
    registry = kopf.OperatorRegistry()
    reconciler = Recorder()
    watches.register(registry, reconciler)  # type: ignore[arg-type]
    return reconciler, {h.selector.any_name if h.selector else "": h for h in registry._watching.get_all_handlers()}


def test_every_watched_kind_reaches_its_reconciler_method() -> None:
    reconciler, by_plural = handlers()
    expected = {
        "models": "on_model",
        "inferenceruntimes": "on_runtime",
        "modelcaches": "on_cache",
        "modelcatalogs": "on_catalog",
        "loraadapters": "on_adapter",
        "deployments": "on_deployment",
        "pods": "on_pod",
    }
    assert set(by_plural) == {*expected, "customresourcedefinitions"}
    for plural, method in expected.items():
        body = {"metadata": {"name": plural}}
        asyncio.run(by_plural[plural].fn(event={"type": "MODIFIED"}, body=body))
        assert reconciler.calls[-1] == (method, "MODIFIED", body)
    # The backends' own objects are watched by the labels the operator puts on them only.
    assert by_plural["deployments"].labels == BACKEND_LABELS == by_plural["pods"].labels


def test_the_scaledobject_crd_is_present_until_deleted() -> None:
    reconciler, by_plural = handlers()
    crd = by_plural["customresourcedefinitions"]
    assert crd.when(name=SCALEDOBJECT_CRD) and not crd.when(name="models.wakegate.io")
    for event_type, present in (("ADDED", True), ("MODIFIED", True), ("DELETED", False)):
        asyncio.run(crd.fn(event={"type": event_type}, body={}))
        assert reconciler.calls[-1] == ("on_keda_crd", present, None)
