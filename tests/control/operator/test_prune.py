"""Failed backend pods (evicted, their node shut down) are deleted by the operator, one line each."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from wakegate.control.k8s import names
from wakegate.control.k8s.client import KubeError
from wakegate.control.operator import render as rnd
from wakegate.control.operator.controller import Reconciler
from wakegate.control.operator.status import failed_pods


def pod(name: str, phase: str, deleting: bool = False, **status: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "labels": names.backend_labels("m")}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase, **status}}


def test_only_finished_failed_pods_are_pruned() -> None:
    pods = [
        pod("evicted", "Failed", reason="Evicted", message="The node was low on resource: memory."),
        pod("shutdown", "Failed", reason="Terminated"),
        pod("bare", "Failed"),
        pod("going", "Failed", deleting=True),
        pod("running", "Running"),
        pod("pending", "Pending"),
        pod("done", "Succeeded"),
    ]
    assert failed_pods(pods) == [
        ("evicted", "Evicted: The node was low on resource: memory."),
        ("shutdown", "Terminated"),
        ("bare", "failed"),
    ]


class Kube:
    """The API server as the reconcile sees it: applies echo, deletes are recorded."""

    def __init__(self, refuse_pods: bool = False) -> None:
        self.deleted: list[str] = []
        self.refuse_pods = refuse_pods

    def get_or_none(self, resource: str) -> Any:
        return None

    def apply(self, obj: dict[str, Any], field_manager: str = names.FIELD_MANAGER, force: bool = True) -> Any:
        return obj

    def delete(self, resource: str) -> bool:
        self.deleted.append(resource)
        if self.refuse_pods and "/pods/" in resource:
            raise KubeError(403, "Forbidden", '{"message": "pods is forbidden"}')
        return True

    def patch_status(self, obj_path: str, status: dict[str, Any]) -> Any:
        return {"status": status}


MODEL = {
    "apiVersion": "wakegate.io/v1alpha1",
    "kind": "Model",
    "metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": 1},
    "spec": {"backend": "sim", "scaling": {"engine": "builtin"}},
}


def test_the_reconcile_deletes_a_models_failed_pods_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    kube = Kube()
    reconciler = Reconciler(kube, rnd.Settings())  # type: ignore[arg-type]
    reconciler.on_model(None, MODEL)
    reconciler.on_pod(None, pod("wg-m-1", "Failed", reason="Evicted", message="low on memory"))
    reconciler.on_pod(None, pod("wg-m-2", "Running"))
    with caplog.at_level(logging.INFO, logger="wakegate.operator"):
        asyncio.run(reconciler.reconcile("ns/m"))
    assert [d for d in kube.deleted if "/pods/" in d] == ["/api/v1/namespaces/ns/pods/wg-m-1"]
    assert any("wg-m-1" in r.getMessage() and "Evicted: low on memory" in r.getMessage() for r in caplog.records)
    assert set(reconciler.pods["ns/m"]) == {"wg-m-2"}
    kube.deleted.clear()
    asyncio.run(reconciler.reconcile("ns/m"))
    assert not [d for d in kube.deleted if "/pods/" in d]


def test_a_refused_delete_is_said_once_and_the_model_still_reconciles(caplog: pytest.LogCaptureFixture) -> None:
    kube = Kube(refuse_pods=True)
    reconciler = Reconciler(kube, rnd.Settings())  # type: ignore[arg-type]
    reconciler.on_model(None, MODEL)
    reconciler.on_pod(None, pod("wg-m-1", "Failed", reason="Evicted"))
    with caplog.at_level(logging.WARNING, logger="wakegate.operator"):
        asyncio.run(reconciler.reconcile("ns/m"))
        asyncio.run(reconciler.reconcile("ns/m"))
    assert [r.getMessage() for r in caplog.records] == [
        "cannot delete failed backend pod ns/wg-m-1: 403 Forbidden: pods is forbidden"
    ]
    assert reconciler.models["ns/m"]["status"]["phase"] in ("Pending", "Idle", "Loading")


def _owned_deletes(kube: Kube) -> list[str]:
    return [d for d in kube.deleted if "/pods/" not in d]


def test_a_new_model_costs_no_prune_delete_a_known_one_is_pruned_as_before() -> None:
    """1,000 new Models must not cost 1,000 DELETEs that answer 404: nothing was rendered for a
    Model no reconcile has finished, but a restarted operator still prunes one it had seen."""
    kube = Kube()
    reconciler = Reconciler(kube, rnd.Settings())  # type: ignore[arg-type]
    reconciler.on_model(None, MODEL)
    asyncio.run(reconciler.reconcile("ns/m"))
    assert _owned_deletes(kube) == []

    # The same Model after a reconcile wrote its status, seen by a fresh operator: its PDB (max 1
    # renders none) may be left over from an earlier spec, so it is deleted.
    kube = Kube()
    reconciler = Reconciler(kube, rnd.Settings())  # type: ignore[arg-type]
    reconciler.on_model(None, {**MODEL, "status": {"observedGeneration": 1, "phase": "Idle"}})
    asyncio.run(reconciler.reconcile("ns/m"))
    assert any("/poddisruptionbudgets/" in d for d in _owned_deletes(kube)), kube.deleted
