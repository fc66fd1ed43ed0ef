"""Model status `routingPath` / `routingPathReason` on a cluster: the feeder's verdict, written by the operator."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.control.operator.test_prune import Kube
from wakegate.control.k8s import names
from wakegate.control.k8s.objects import model_from_object
from wakegate.control.operator import render as rnd
from wakegate.control.operator.controller import Reconciler
from wakegate.control.operator.status import routing_path_status

NATIVE = {"strategy": "round-robin", "path": "native"}

OFF = "the gateway's native path is off (API keys or a global rate limit on the cluster)"


def model(routing: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "wakegate.io/v1alpha1",
        "kind": "Model",
        "metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": 1},
        "spec": {"backend": "sim", "scaling": {"engine": "builtin"}, "routing": routing or NATIVE, **spec},
    }


def pod(
    name: str = "wg-m-1", ready: bool = True, ip: str | None = "10.0.0.7", deleting: bool = False
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "labels": names.backend_labels("m")}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-02T00:00:00Z"
    status: dict[str, Any] = {"phase": "Running", "conditions": [{"type": "Ready", "status": str(ready)}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


@pytest.mark.parametrize(
    ("body", "pods", "admitted", "allowed", "want"),
    [
        (model(), [pod()], True, True, ("native", None)),
        (model(), [pod()], True, False, ("decided", OFF)),
        (model({"strategy": "round-robin"}), [pod()], True, True, ("decided", "routing.path is decided")),
        (model({**NATIVE, "strategy": "prefix"}), [pod()], True, True, ("decided", "scored or sticky picking")),
        (model({**NATIVE, "strategy": "least-loaded"}), [pod()], True, True, ("native", None)),
        (model(loraAdapters=["tone"]), [pod()], True, True, ("decided", "LoRA adapters")),
        # A per-model limit keeps no model decided: Envoy keeps its bucket (docs/decisions.md).
        (model(limits={"requestsPerSecond": 5}), [pod()], True, True, ("native", None)),
        (model(), [pod()], False, True, ("decided", "waiting for its GPU group")),
        (model(), [], True, True, ("decided", "no ready endpoint")),
        (model(), [pod(ready=False)], True, True, ("decided", "no ready endpoint")),
        (model(), [pod(ip=None)], True, True, ("decided", "no ready endpoint")),
        (model(), [pod(deleting=True)], True, True, ("decided", "no ready endpoint")),
        (model(), [pod(deleting=True), pod("wg-m-2")], True, True, ("native", None)),
    ],
)
def test_the_status_says_the_feeders_verdict(
    body: dict[str, Any], pods: list[dict[str, Any]], admitted: bool, allowed: bool, want: tuple[str, str | None]
) -> None:
    status = routing_path_status(model_from_object(body), pods, admitted, allowed)
    path, reason = want
    assert status["routingPath"] == path
    if reason is None:
        assert status["routingPathReason"] is None  # the merge patch removes an old reason
    else:
        assert status["routingPathReason"].startswith(reason)


class Recording(Kube):
    def __init__(self) -> None:
        super().__init__()
        self.patches: list[dict[str, Any]] = []

    def patch_status(self, obj_path: str, status: dict[str, Any]) -> Any:
        self.patches.append(dict(status))
        return {"status": {k: v for k, v in status.items() if v is not None}}


def test_the_reconcile_writes_the_path_as_endpoints_come_and_go_and_only_when_it_changes() -> None:
    kube = Recording()
    reconciler = Reconciler(kube, rnd.Settings(native_path=True))  # type: ignore[arg-type]
    reconciler.on_model(None, model())

    def reconcile() -> dict[str, Any]:
        asyncio.run(reconciler.reconcile("ns/m"))
        return dict(reconciler.models["ns/m"]["status"])

    cold = reconcile()
    assert (cold["routingPath"], cold["routingPathReason"]) == ("decided", "no ready endpoint")
    reconciler.on_pod(None, pod())
    warm = reconcile()
    assert warm["routingPath"] == "native" and "routingPathReason" not in warm
    assert kube.patches[-1]["routingPathReason"] is None
    patches = len(kube.patches)
    reconcile()
    assert len(kube.patches) == patches  # nothing changed, nothing written
    reconciler.on_pod("DELETED", pod())
    assert reconcile()["routingPathReason"] == "no ready endpoint"


def test_without_native_path_every_model_is_decided() -> None:
    kube = Recording()
    reconciler = Reconciler(kube, rnd.Settings())  # type: ignore[arg-type]
    reconciler.on_model(None, model())
    reconciler.on_pod(None, pod())
    asyncio.run(reconciler.reconcile("ns/m"))
    status = reconciler.models["ns/m"]["status"]
    assert (status["routingPath"], status["routingPathReason"]) == ("decided", OFF)
