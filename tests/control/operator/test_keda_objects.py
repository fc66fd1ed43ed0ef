"""The operator's KEDA objects: applied for `engine: keda`, updated with the spec, removed when the engine changes."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from wakegate.control.k8s import names
from wakegate.control.operator import render as rnd
from wakegate.control.operator.controller import Reconciler


class Kube:
    """The API server as the reconcile sees it: applies and deletes are recorded."""

    def __init__(self) -> None:
        self.applied: list[dict[str, Any]] = []
        self.deleted: list[str] = []

    def get_or_none(self, resource: str) -> Any:
        return None

    def apply(self, obj: dict[str, Any], field_manager: str = names.FIELD_MANAGER, force: bool = True) -> Any:
        self.applied.append(copy.deepcopy(obj))
        return obj

    def delete(self, resource: str) -> bool:
        self.deleted.append(resource)
        return True

    def patch_status(self, obj_path: str, status: dict[str, Any]) -> Any:
        return {"status": status}

    def take(self) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """What was applied (by kind, the last of each) and deleted since the last call."""
        applied = {o["kind"]: o for o in self.applied if o.get("spec", {}).get("template") or o["kind"] != "Deployment"}
        deleted = [path.rsplit("/", 2)[1] for path in self.deleted]
        self.applied, self.deleted = [], []
        return applied, deleted


def model(generation: int, **scaling: Any) -> dict[str, Any]:
    return {
        "apiVersion": "wakegate.io/v1alpha1",
        "kind": "Model",
        "metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": generation},
        "spec": {"backend": "sim", "scaling": {"min": 0, **scaling}},
    }


def reconcile(reconciler: Reconciler, body: dict[str, Any]) -> None:
    reconciler.on_model(None, body)
    asyncio.run(reconciler.reconcile("ns/m"))


def test_keda_objects_follow_the_spec_and_go_when_the_engine_changes() -> None:
    kube = Kube()
    reconciler = Reconciler(kube, rnd.Settings(scaler_address="s:9091", keda_auth_secret="keda-client"))  # type: ignore[arg-type]

    reconcile(reconciler, model(1, max=2, engine="keda"))
    applied, deleted = kube.take()
    assert {"TriggerAuthentication", "ScaledObject"} <= set(applied)
    so = applied["ScaledObject"]
    assert so["spec"]["maxReplicaCount"] == 2 and so["spec"]["cooldownPeriod"] == 0
    assert so["metadata"]["ownerReferences"][0]["uid"] == "u"
    assert so["spec"]["triggers"][0]["authenticationRef"] == {"name": "wg-m"}
    assert "scaledobjects" not in deleted and "triggerauthentications" not in deleted

    reconcile(reconciler, model(2, max=4, engine="keda"))
    applied, deleted = kube.take()
    assert applied["ScaledObject"]["spec"]["maxReplicaCount"] == 4
    assert "scaledobjects" not in deleted

    reconcile(reconciler, model(3, max=4, engine="builtin"))
    applied, deleted = kube.take()
    assert "ScaledObject" not in applied and "TriggerAuthentication" not in applied
    assert {"scaledobjects", "triggerauthentications"} <= set(deleted)


def test_without_the_auth_secret_the_trigger_authentication_is_removed() -> None:
    kube = Kube()
    reconciler = Reconciler(kube, rnd.Settings(keda_auth_secret="keda-client"))  # type: ignore[arg-type]
    reconcile(reconciler, model(1))
    kube.take()
    reconciler.settings = rnd.Settings()
    reconciler.applied.clear()
    reconcile(reconciler, model(1))
    applied, deleted = kube.take()
    assert "TriggerAuthentication" not in applied
    assert "authenticationRef" not in applied["ScaledObject"]["spec"]["triggers"][0]
    assert "triggerauthentications" in deleted and "scaledobjects" not in deleted
