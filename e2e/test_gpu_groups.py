"""GPU groups on the real control plane: a swap whose two members' pods never overlap.

The operator renders two Models of one GPU group from an InferenceRuntime whose pods take a
while to stop (a preStop sleep inside a longer grace period); `wakegate scaler` arbitrates the
group from the demand the gateway (xds + extproc + Envoy) reports, and writes replicas (builtin
engine). A watch on the backend pods records every event in the order the API server commits
them, so "the incoming member's first pod is created after the outgoing member's last pod is
deleted" is checked on that order, not on clocks.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, watch

from e2e.gateway import Gateway, Operator, Scaler, install_crds, running
from e2e.helpers import Kube
from e2e.test_operator import apply, get_model, kubectl, model_yaml, phase, wait_phase
from tests.support.models import sim_runtime
from tests.support.waiting import wait_for
from wakegate.control.admin import free_port
from wakegate.control.k8s import names

pytestmark = pytest.mark.e2e

#: The runtime's drain: the preStop sleep, inside the grace period the pods get.
PRESTOP_SECONDS = 4
GRACE_SECONDS = 20


@dataclass(frozen=True)
class PodEvent:
    type: str
    model: str
    pod: str
    terminating: bool
    grace: int | None
    phase: str
    at: float


class PodRecorder:
    """Every backend pod event of one namespace, in the order the watch delivers them."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.events: list[PodEvent] = []
        self._watch = watch.Watch()
        self._started = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        core = client.CoreV1Api(self.kube.api)
        version = core.list_namespaced_pod(self.kube.ns).metadata.resource_version
        self._started.set()
        stream = self._watch.stream(
            core.list_namespaced_pod,
            self.kube.ns,
            label_selector=f"{names.LABEL_COMPONENT}=model-backend",
            resource_version=version,
            timeout_seconds=600,
        )
        try:
            for event in stream:
                self._record(event)
        except Exception:  # the watch is cut when the test ends, or the API server goes away
            if not self._stopped.is_set():
                raise

    def _record(self, event: dict[str, Any]) -> None:
        if event:
            meta = event["object"].metadata
            self.events.append(
                PodEvent(
                    event["type"],
                    meta.labels.get(names.LABEL_MODEL, ""),
                    meta.name,
                    meta.deletion_timestamp is not None,
                    meta.deletion_grace_period_seconds,
                    str(event["object"].status.phase),
                    time.monotonic(),
                )
            )

    def __enter__(self) -> PodRecorder:
        self._thread.start()
        self._started.wait(30)
        return self

    def __exit__(self, *_: object) -> None:
        self._stopped.set()
        self._watch.stop()

    def of(self, model: str) -> list[tuple[int, PodEvent]]:
        return [(i, e) for i, e in enumerate(list(self.events)) if e.model == model]


def runtime(name: str) -> dict[str, Any]:
    return sim_runtime(name, {"preStopDrainSeconds": PRESTOP_SECONDS, "terminationGracePeriodSeconds": GRACE_SECONDS})


def lists(url: str, model: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as resp:
            return model in {m.get("id") for m in json.load(resp).get("data", [])}
    except (OSError, ValueError):
        return False


def ask(gateway: Gateway, answers: list[tuple[int, dict[str, Any]]]) -> None:
    """One request for b, held until b serves it; a cut connection counts as status 0."""
    try:
        answers.append(gateway.chat("b", timeout=150))
    except OSError as exc:
        answers.append((0, {"error": str(exc)}))


@pytest.fixture
def group_runtime(kube: Kube) -> Iterator[str]:
    install_crds(kube.api)
    name = f"sim-drain-{kube.ns}"
    apply(kube, yaml.safe_dump(runtime(name)))
    yield name
    kubectl(kube, "delete", "inferenceruntime", name, "--wait=false", check=False)


def test_gpu_group_swap_never_overlaps_pods_and_the_waiting_member_names_its_peer(
    kube: Kube, group_runtime: str, tmp_path: Path
) -> None:
    demand = f"127.0.0.1:{free_port()}"
    gateway = Gateway(tmp_path, kube.cluster.kubeconfig, demand=demand)
    scaler = Scaler(tmp_path, kube.cluster.kubeconfig, kube.ns, gateway.token, demand)
    op = Operator(tmp_path, kube.cluster.kubeconfig, kube.ns, "operator", ["--renew-seconds", "1"])
    ref = {"runtimeRef": {"name": group_runtime}}
    group = {"shared": "g", "minRunSeconds": 0, "swapCooldownSeconds": 600}
    peer_a = names.model_key(kube.ns, "a")

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.tail(30)}" for p in (op.proc, scaler.proc, *gateway.procs))

    with running(op, gateway, scaler), PodRecorder(kube) as pods:
        wait_for(scaler.leads, 30, "the scaler to hold its Lease")
        apply(kube, model_yaml("a", scaling={"engine": "builtin", "min": 1, "max": 1}, gpu=group, **ref))
        b_spec = {"engine": "builtin", "min": 0, "max": 1, "idleTimeout": 60, "activationTimeout": 120}
        b_gpu = {**group, "demandWindowSeconds": 2, "queueThreshold": 2}
        apply(kube, model_yaml("b", scaling=b_spec, gpu=b_gpu, **ref))
        wait_phase(kube, "a", "Ready", timeout=90)
        wait_phase(kube, "b", "Idle")
        wait_for(lambda: lists(gateway.url, "b"), 60, f"the gateway routing b\n{logs()}")

        # One request: below b's queueThreshold (2). It is held; b waits for a and says so.
        answers: list[tuple[int, dict[str, Any]]] = []
        first = threading.Thread(target=ask, args=(gateway, answers))
        first.start()
        wait_for(lambda: phase(kube, "b") == "Waiting", 30, f"b Waiting\n{logs()}", every=0.2)
        status = get_model(kube, "b")["status"]
        assert status["waitingFor"] == peer_a and status["admitted"] is False
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        assert (ready["reason"], peer_a in ready["message"]) == ("WaitingForGroup", True), ready
        columns = kubectl(kube, "get", "models", "b").stdout
        assert "Waiting" in columns and peer_a in columns, columns
        # Well past the demand window (2 s), a still holds the group: no swap below the threshold.
        time.sleep(6)
        assert not kube.apps.read_namespaced_deployment_scale("wg-b", kube.ns).spec.replicas
        assert not pods.of("b"), pods.of("b")
        assert phase(kube, "a") == "Ready" and phase(kube, "b") == "Waiting"

        # A second request reaches the threshold: a is swapped out, and b starts once a's pod is gone.
        second = threading.Thread(target=ask, args=(gateway, answers))
        second.start()
        first.join(150)
        second.join(150)
        assert [code for code, _ in answers] == [200, 200], f"{answers}\n{logs()}"
        wait_phase(kube, "b", "Ready")
        assert "waitingFor" not in get_model(kube, "b")["status"]
        wait_phase(kube, "a", "Preempted")
        time.sleep(1)  # the last pod events reach the recorder

    a_events, b_events = pods.of("a"), pods.of("b")
    a_deleted = [i for i, e in a_events if e.type == "DELETED"]
    b_added = [i for i, e in b_events if e.type == "ADDED"]
    assert a_deleted and b_added, (a_events, b_events)
    timeline = "\n".join(f"{i:3d} {e.type:8s} {e.model} {e.pod} {e.phase} terminating={e.terminating}"
                         for i, e in sorted(a_events + b_events))
    assert max(a_deleted) < min(b_added), f"b's first pod was created before a's last one was deleted:\n{timeline}"
    # The drain honoured the runtime's grace period: a's pod was deleted with it, and the deletion
    # waited for the preStop sleep before the pod left the API.
    marked = next(e for _, e in a_events if e.terminating)
    gone = next(e for _, e in a_events if e.type == "DELETED")
    assert marked.grace == GRACE_SECONDS, timeline
    assert gone.at - marked.at >= PRESTOP_SECONDS - 0.5, timeline
    handover = next(e for _, e in b_events if e.type == "ADDED").at - marked.at
    drain = gone.at - marked.at
    print(f"\n{timeline}\na's drain took {drain:.1f}s; b's first pod {handover:.1f}s after a's deletion began")
