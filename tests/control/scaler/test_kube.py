"""The scaler's cluster adapters: the pod count a GPU-group hand-over waits on, and what it writes
while it leads (status.waitingFor, replicas), against a recording stand-in for the API."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter

from tests.support.models import models
from wakegate.control.k8s.client import KubeError
from wakegate.control.manifests import parse_models
from wakegate.control.scaler.kube import BuiltinEngine, WaitingWriter, pods_per_model
from wakegate.control.scaling.core import Verdict

MODELS = models({"a": {"gpu": {"shared": "g"}}, "solo": {}})
BUILTIN = models({f"m{i}": {"scaling": {"engine": "builtin", "min": 0, "max": 1}} for i in range(50)})


def pod(model: str | None, phase: str = "Running", terminating: bool = False) -> dict[str, Any]:
    labels = {"wakegate.io/model": model} if model else {}
    meta: dict[str, Any] = {"name": f"p-{model}", "namespace": "ns", "labels": labels}
    if terminating:
        meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase}}


@pytest.mark.parametrize(
    ("pods", "expected"),
    [
        pytest.param([pod("a"), pod("a", phase="Pending")], {"ns/a": 2}, id="running-and-pending"),
        # A terminating pod may still hold the accelerator (preStop, drain): it counts until deleted.
        pytest.param([pod("a", terminating=True)], {"ns/a": 1}, id="terminating"),
        # Its containers exited, but it is not deleted yet: it still counts (until DELETED).
        pytest.param([pod("a", phase="Succeeded", terminating=True)], {"ns/a": 1}, id="terminating-ended"),
        # Ended on its own (evicted) and left behind: it holds nothing.
        pytest.param([pod("a", phase="Failed"), pod("a", phase="Succeeded")], {}, id="ended"),
        pytest.param([pod(None)], {}, id="not-a-backend"),
        pytest.param([], {}, id="none"),
    ],
)
def test_pods_per_model(pods: list[dict[str, Any]], expected: dict[str, int]) -> None:
    assert pods_per_model(pods) == expected


class RecordingKube:
    def __init__(self, fail: int = 0) -> None:
        self.patches: list[tuple[str, Any, str]] = []
        self.fail = fail

    def merge_patch(self, resource: str, patch: Any, field_manager: str) -> Any:
        if self.fail:
            self.fail -= 1
            raise KubeError(500, "Internal Server Error", "boom")
        self.patches.append((resource, patch, field_manager))
        return {}


def verdict(waiting_for: str | None) -> Verdict:
    return Verdict(
        replicas=0, active=False, demand=0, busy=waiting_for is not None, target_in_flight=8, waiting_for=waiting_for
    )


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0.01)


async def test_waiting_writer_writes_each_change_once_while_it_leads() -> None:
    kube = RecordingKube()
    writer = WaitingWriter(kube, lambda: None)  # type: ignore[arg-type]
    writer.models = {m.key: m for m in parse_models(MODELS)}
    writer.apply({"ns/a": verdict("ns/b"), "ns/solo": verdict(None)})
    await _settle()
    assert kube.patches == [], "a follower writes nothing"

    writer.set_leader(True)
    writer.apply({"ns/a": verdict("ns/b"), "ns/solo": verdict(None)})
    await _settle()
    target = "/apis/wakegate.io/v1alpha1/namespaces/ns/models/a/status"
    assert kube.patches == [(target, {"status": {"waitingFor": "ns/b"}}, "wakegate-scaler")]
    writer.apply({"ns/a": verdict("ns/b")})
    await _settle()
    assert len(kube.patches) == 1, "an unchanged value is not written again"
    writer.apply({"ns/a": verdict(None)})
    await _settle()
    assert kube.patches[-1] == (target, {"status": {"waitingFor": None}}, "wakegate-scaler"), "null clears it"


async def test_waiting_writer_retries_a_failed_write(monkeypatch: pytest.MonkeyPatch) -> None:
    from wakegate.control.scaler import kube as adapters

    monkeypatch.setattr(adapters, "RETRY_SECONDS", 0.05)
    kube = RecordingKube(fail=1)
    retries: list[bool] = []
    writer = WaitingWriter(kube, lambda: retries.append(True))  # type: ignore[arg-type]
    writer.models = {m.key: m for m in parse_models(MODELS)}
    writer.set_leader(True)
    retries.clear()
    writer.apply({"ns/a": verdict("ns/b")})
    await _settle()  # the failure asks for another evaluation after RETRY_SECONDS
    assert retries and kube.patches == []
    writer.apply({"ns/a": verdict("ns/b")})
    await _settle()
    assert kube.patches[-1][1] == {"status": {"waitingFor": "ns/b"}}


class Patches:
    """The scaler metrics' one counter the builtin engine moves: scale patches by model and result."""

    def __init__(self) -> None:
        self.scale_patches = Counter("scale_patches", "", ["model", "result"], registry=CollectorRegistry())

    def count(self, result: str) -> float:
        return sum(
            s.value
            for m in self.scale_patches.collect()
            for s in m.samples
            if s.name.endswith("_total") and s.labels["result"] == result
        )


class NoDeployments:
    """The API before the operator made any Deployment: every scale write is a 404, until `make`."""

    def __init__(self) -> None:
        self.tries: list[str] = []
        self.made: set[str] = set()
        self.patches: list[tuple[str, Any]] = []

    def merge_patch(self, resource: str, patch: Any, field_manager: str) -> Any:
        self.tries.append(resource)
        if not any(resource.endswith(f"/deployments/wg-{name}/scale") for name in self.made):
            raise KubeError(404, "Not Found", "deployments.apps not found")
        self.patches.append((resource, patch))
        return {}


def replicas(n: int) -> Verdict:
    return Verdict(replicas=n, active=n > 0, demand=n, busy=False, target_in_flight=8, waiting_for=None)


async def test_a_missing_deployment_is_written_once_it_exists_not_every_retry(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Fifty new Models before the operator made their Deployments: one try each (one INFO line,
    no warning), no tries on later evaluations; the Model's next event (the operator's status
    write after it applied the Deployment) writes at once."""
    from wakegate.control.scaler import kube as adapters

    monkeypatch.setattr(adapters, "RETRY_SECONDS", 0.01)
    kube = NoDeployments()
    pokes: list[bool] = []
    metrics = Patches()
    engine = BuiltinEngine(kube, metrics, lambda: pokes.append(True))  # type: ignore[arg-type]
    engine.models = {m.key: m for m in parse_models(BUILTIN)}
    engine.set_leader(True)
    verdicts = {key: replicas(0) for key in engine.models}
    with caplog.at_level("INFO", logger="wakegate.scaler.kube"):
        engine.apply(verdicts)
        await _settle()
        for _ in range(5):  # the evaluations that follow (demand reports, retries) try nothing
            engine.apply(verdicts)
            await _settle()
    assert len(kube.tries) == 50 and kube.patches == []
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert len([r for r in caplog.records if "not written yet" in r.message]) == 50
    assert metrics.count("not_found") == 50

    kube.made.add("m7")
    engine.apply({"ns/m7": replicas(1)})  # a request for it: still held back (no news of its Deployment)
    await _settle()
    assert kube.patches == []
    engine.model_event("ns/m7")  # the operator wrote its status: the Deployment is there
    await _settle()
    assert kube.patches == [("/apis/apps/v1/namespaces/ns/deployments/wg-m7/scale", {"spec": {"replicas": 1}})]
    engine.model_event("ns/m8")  # news of a Model whose Deployment is still missing: one more try
    await _settle()
    assert len(kube.tries) == 52


async def test_a_missing_deployment_is_tried_again_after_a_while_without_news(monkeypatch: pytest.MonkeyPatch) -> None:
    from wakegate.control.scaler import kube as adapters

    monkeypatch.setattr(adapters, "ABSENT_RETRY_SECONDS", 0.05)
    kube = NoDeployments()
    pokes: list[bool] = []
    engine = BuiltinEngine(kube, Patches(), lambda: pokes.append(True))  # type: ignore[arg-type]
    engine.models = {m.key: m for m in parse_models(BUILTIN)}
    engine.set_leader(True)
    pokes.clear()
    engine.apply({"ns/m1": replicas(1)})
    await _settle()
    assert pokes, "the missing target asks for another evaluation later"
    kube.made.add("m1")
    engine.apply({"ns/m1": replicas(1)})
    await _settle()
    assert kube.patches == [("/apis/apps/v1/namespaces/ns/deployments/wg-m1/scale", {"spec": {"replicas": 1}})]


async def test_a_404_racing_the_news_of_the_deployment_is_retried_soon(monkeypatch: pytest.MonkeyPatch) -> None:
    """The write was in flight when the Model's event arrived: its 404 may predate the Deployment."""
    from wakegate.control.scaler import kube as adapters

    monkeypatch.setattr(adapters, "RETRY_SECONDS", 0.01)
    kube = NoDeployments()
    engine = BuiltinEngine(kube, Patches(), lambda: None)  # type: ignore[arg-type]
    engine.models = {m.key: m for m in parse_models(BUILTIN)}
    engine.set_leader(True)
    real_patch = kube.merge_patch

    def patch_then_news(resource: str, patch: Any, field_manager: str) -> Any:
        try:
            return real_patch(resource, patch, field_manager)
        finally:
            loop.call_soon_threadsafe(engine.model_event, "ns/m2")

    loop = asyncio.get_running_loop()
    kube.merge_patch = patch_then_news  # type: ignore[method-assign]
    engine.apply({"ns/m2": replicas(1)})
    await _settle()
    kube.made.add("m2")
    engine.apply({"ns/m2": replicas(1)})
    await _settle()
    assert kube.patches == [("/apis/apps/v1/namespaces/ns/deployments/wg-m2/scale", {"spec": {"replicas": 1}})]
