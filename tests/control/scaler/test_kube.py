"""The scaler's cluster adapters: the pod count a GPU-group hand-over waits on, and what it writes
while it leads (status.waitingFor, replicas), against a recording stand-in for the API."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.support.models import models
from wakegate.control.k8s.client import KubeError
from wakegate.control.manifests import parse_models
from wakegate.control.scaler.kube import WaitingWriter, pods_per_model
from wakegate.control.scaling.core import Verdict

MODELS = models({"a": {"gpu": {"shared": "g"}}, "solo": {}})


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
