"""`wakegate operator` on the real control plane: kubectl-applied Models become running, routable backends.

Each test runs its own operator process(es) against the session's cluster, with
the leader Lease in the test's namespace. Models use the simulator image, which
the node agent runs as a real process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.gateway import (
    LEASE_RULES,
    OPERATOR_RULES,
    Gateway,
    Operator,
    install_crds,
    python_env,
    running,
    scoped_kubeconfig,
)
from e2e.helpers import Kube
from e2e.procs import Proc
from tests.support.models import sim_runtime
from tests.support.waiting import wait_for
from wakegate.control.admin import free_port

pytestmark = pytest.mark.e2e

GROUP, VERSION = "wakegate.io", "v1alpha1"
KEDA_CRD = "scaledobjects.keda.sh"


@pytest.fixture
def wg(kube: Kube, tmp_path: Path) -> Iterator[Kube]:
    """The test namespace with the wakegate CRDs installed."""
    install_crds(kube.api)
    yield kube


def kubectl(kube: Kube, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["kubectl", "--kubeconfig", str(kube.cluster.kubeconfig), "-n", kube.ns, *args],
        input=stdin,
        capture_output=True,
        text=True,
        check=check,
        timeout=60,
    )


def model_yaml(name: str, **spec: Any) -> str:
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Model",
        "metadata": {"name": name},
        "spec": {"backend": "sim", **spec},
    }
    return yaml.safe_dump(body)


def apply(kube: Kube, text: str) -> str:
    return kubectl(kube, "apply", "-f", "-", stdin=text).stdout


def get_model(kube: Kube, name: str) -> dict[str, Any]:
    body: dict[str, Any] = kube.custom.get_namespaced_custom_object(GROUP, VERSION, kube.ns, "models", name)
    return body


def phase(kube: Kube, name: str) -> str:
    return str((get_model(kube, name).get("status") or {}).get("phase", ""))


def condition(kube: Kube, name: str, type_: str) -> dict[str, Any]:
    for cond in (get_model(kube, name).get("status") or {}).get("conditions") or []:
        if cond["type"] == type_:
            return dict(cond)
    return {}


def wait_phase(kube: Kube, name: str, want: str, timeout: float = 60) -> None:
    wait_for(lambda: phase(kube, name) == want, timeout, f"Model {name} phase {want}", every=0.5)


def rv(kube: Kube, kind: str, name: str) -> str:
    if kind == "Model":
        return str(get_model(kube, name)["metadata"]["resourceVersion"])
    if kind == "Deployment":
        return str(kube.apps.read_namespaced_deployment(name, kube.ns).metadata.resource_version)
    return str(kube.core.read_namespaced_service(name, kube.ns).metadata.resource_version)


def operator(kube: Kube, tmp: Path, name: str = "operator", *extra: str) -> Operator:
    return Operator(tmp, kube.cluster.kubeconfig, kube.ns, name, ["--renew-seconds", "1", *extra])


def test_model_applied_with_kubectl_becomes_ready_routes_and_wakes_from_zero(wg: Kube, tmp_path: Path) -> None:
    demand, keda, admin = free_port(), free_port(), free_port()
    gateway = Gateway(tmp_path, wg.cluster.kubeconfig, demand=f"127.0.0.1:{demand}")
    scaler = Proc(
        "scaler",
        [
            "python",
            "-m",
            "wakegate",
            "scaler",
            "--kubeconfig",
            str(wg.cluster.kubeconfig),
            "--demand-listen",
            f"127.0.0.1:{demand}",
            "--keda-listen",
            f"127.0.0.1:{keda}",
            "--admin-listen",
            f"127.0.0.1:{admin}",
            "--lease-namespace",
            wg.ns,
            "--internal-token-file",
            str(gateway.token),
        ],
        tmp_path / "scaler.log",
        env=python_env(),
    )
    spec = {"scaling": {"min": 1, "max": 1, "engine": "builtin", "idleTimeout": 2, "activationTimeout": 60}}
    with running(operator(wg, tmp_path), gateway):
        scaler.start()
        try:
            started = time.monotonic()
            apply(wg, model_yaml("chat", **spec))
            wait_phase(wg, "chat", "Ready")
            ready_after = time.monotonic() - started
            answered = wait_for(lambda: _ok(gateway.chat("chat")), 30, "a routed answer")
            assert answered is not None
            status, body = answered
            assert body["model"] == "chat"
            # Allow scale to zero: the scaler sees no demand for idleTimeout and scales to 0.
            spec["scaling"]["min"] = 0
            apply(wg, model_yaml("chat", **spec))
            wait_phase(wg, "chat", "Idle", timeout=60)
            assert not wg.pods("wakegate.io/model=chat") or all(
                p.metadata.deletion_timestamp for p in wg.pods("wakegate.io/model=chat")
            )
            cold = time.monotonic()
            status, body = gateway.chat("chat", timeout=90)
            cold_seconds = time.monotonic() - cold
            assert status == 200, body
            assert body["model"] == "chat"
            wait_phase(wg, "chat", "Ready")
            model = get_model(wg, "chat")
            assert model["status"]["lastColdStartSeconds"] > 0
            print(f"ready after {ready_after:.1f}s, cold request answered in {cold_seconds:.1f}s")
        finally:
            scaler.stop()


def _ok(result: tuple[int, dict[str, Any]]) -> tuple[int, dict[str, Any]] | None:
    return result if result[0] == 200 else None


def test_reapply_changes_nothing_spec_changes_roll_only_what_they_should_delete_removes_all(
    wg: Kube, tmp_path: Path
) -> None:
    spec: dict[str, Any] = {"scaling": {"min": 1, "max": 2, "engine": "builtin"}, "args": ["--drain-seconds", "0"]}
    with running(operator(wg, tmp_path)):
        apply(wg, model_yaml("stable", **spec))
        wait_phase(wg, "stable", "Ready")
        time.sleep(2)  # let the last pod/endpoint events settle
        before = {
            k: rv(wg, k, n) for k, n in (("Model", "stable"), ("Deployment", "wg-stable"), ("Service", "wg-stable"))
        }
        out = apply(wg, model_yaml("stable", **spec))
        assert "unchanged" in out
        quiet = float(os.environ.get("WAKEGATE_E2E_QUIET_SECONDS", "60"))
        time.sleep(quiet)
        after = {
            k: rv(wg, k, n) for k, n in (("Model", "stable"), ("Deployment", "wg-stable"), ("Service", "wg-stable"))
        }
        assert after == before, f"objects changed without a spec change during {quiet}s: {before} -> {after}"
        # A routing-only field changes no Kubernetes object.
        apply(wg, model_yaml("stable", **spec, limits={"requestsPerSecond": 5}))
        time.sleep(3)
        assert rv(wg, "Deployment", "wg-stable") == before["Deployment"]
        assert rv(wg, "Service", "wg-stable") == before["Service"]
        # A backend argument rolls the Deployment's pods; the Service stays.
        generation = wg.apps.read_namespaced_deployment("wg-stable", wg.ns).metadata.generation
        apply(wg, model_yaml("stable", **{**spec, "args": ["--drain-seconds", "0", "--ttft-ms", "1"]}))
        wait_for(
            lambda: wg.apps.read_namespaced_deployment("wg-stable", wg.ns).metadata.generation > generation,
            20,
            "the Deployment to roll",
        )
        assert rv(wg, "Service", "wg-stable") == before["Service"]
        dep = wg.apps.read_namespaced_deployment("wg-stable", wg.ns)
        assert dep.spec.template.spec.containers[0].args[-2:] == ["--ttft-ms", "1"]
        # max back to 1: the PodDisruptionBudget is no longer rendered and goes away.
        policy = client.PolicyV1Api(wg.api)
        assert policy.read_namespaced_pod_disruption_budget("wg-stable", wg.ns)
        apply(wg, model_yaml("stable", **{**spec, "scaling": {"min": 1, "max": 1, "engine": "builtin"}}))
        wait_for(lambda: _gone(lambda: policy.read_namespaced_pod_disruption_budget("wg-stable", wg.ns)), 20, "PDB")
        kubectl(wg, "delete", "model", "stable", "--wait=true")
        wait_for(lambda: _gone(lambda: wg.apps.read_namespaced_deployment("wg-stable", wg.ns)), 30, "Deployment gone")
        wait_for(lambda: _gone(lambda: wg.core.read_namespaced_service("wg-stable", wg.ns)), 30, "Service gone")
        wait_for(lambda: not wg.pods("wakegate.io/model=stable"), 30, "pods gone")


def _gone(read: Any) -> bool:
    try:
        read()
    except ApiException as exc:
        return bool(exc.status == 404)
    return False


def test_each_failure_reason_appears_in_status(wg: Kube, tmp_path: Path) -> None:
    slow = sim_runtime(f"sim-deadline-{wg.ns}", {"preStopDrainSeconds": 0, "progressDeadlineSeconds": 4})
    bad_image: dict[str, Any] = {
        **slow,
        "metadata": {"name": f"sim-badimage-{wg.ns}"},
        "spec": {**slow["spec"], "image": "registry.invalid/nope:1"},
    }
    builtin = {"scaling": {"engine": "builtin"}}
    models: dict[str, tuple[str, str, dict[str, Any]]] = {
        "pull": ("ImagePullBackOff", "BackendHealthy", {"runtimeRef": {"name": bad_image["metadata"]["name"]}}),
        "crash": ("CrashLoopBackOff", "BackendHealthy", {"args": ["--fail-after-seconds", "0", "--exit-code", "3"]}),
        "oom": ("OOMKilled", "BackendHealthy", {"args": ["--fail-after-seconds", "0", "--exit-code", "137"]}),
        "deadline": (
            "ProgressDeadlineExceeded",
            "BackendHealthy",
            {"runtimeRef": {"name": slow["metadata"]["name"]}, "args": ["--never-ready"]},
        ),
        "nofit": ("Unschedulable", "Schedulable", {"nodeSelector": {"wakegate.io/no-such-node": "true"}}),
    }
    try:
        apply(wg, yaml.safe_dump_all([slow, bad_image]))
        with running(operator(wg, tmp_path)):
            apply(wg, "---\n".join(model_yaml(n, **builtin, **extra) for n, (_, _, extra) in models.items()))
            for name, (reason, cond_type, _) in models.items():
                wait_for(_reason_is(wg, name, cond_type, reason), 90, f"{name}: {cond_type} reason {reason}", every=0.5)
            table = kubectl(wg, "get", "models").stdout
            print(table)
            for name, (reason, _, _) in models.items():
                row = next(line for line in table.splitlines() if line.startswith(name + " "))
                assert reason in row, row
                expected = "Pending" if reason == "Unschedulable" else "Failed"
                assert expected in row, row
    finally:
        kubectl(wg, "delete", "inferenceruntime", slow["metadata"]["name"], bad_image["metadata"]["name"], check=False)


def _reason_is(kube: Kube, name: str, cond_type: str, reason: str) -> Callable[[], bool]:
    return lambda: condition(kube, name, cond_type).get("reason") == reason


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ({"spec": {"backend": "nope"}}, "spec.backend"),
        ({"spec": {"backend": "sim", "scaling": {"min": 3, "max": 2}}}, "scaling.min must not exceed scaling.max"),
        ({"spec": {"backend": "sim", "source": "ftp://x"}}, "spec.source"),
        ({"spec": {"backend": "sim", "endpoint": {"coldMode": "sometimes"}}}, "spec.endpoint.coldMode"),
        ({"metadata": {"name": "x" * 61}}, "metadata.name must be at most 60 characters"),
    ],
)
def test_invalid_models_are_refused_naming_the_field(wg: Kube, patch: dict[str, Any], needle: str) -> None:
    body: dict[str, Any] = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Model",
        "metadata": {"name": "bad", **patch.get("metadata", {})},
        "spec": patch.get("spec", {"backend": "sim"}),
    }
    result = kubectl(wg, "apply", "-f", "-", stdin=yaml.safe_dump(body), check=False)
    assert result.returncode != 0
    assert needle in result.stderr, result.stderr


def test_keda_engine_renders_a_scaledobject_and_without_its_crd_creates_no_deployment(wg: Kube, tmp_path: Path) -> None:
    ext = client.ApiextensionsV1Api(wg.api)
    with running(operator(wg, tmp_path, "operator", "--scaler-address", "scaler.test:9091")):
        apply(wg, model_yaml("kd", scaling={"min": 0, "max": 3}))
        so: dict[str, Any] = wait_for(lambda: _scaled_object(wg, "wg-kd") or {}, 30, "ScaledObject wg-kd")
        trigger = so["spec"]["triggers"][0]
        assert trigger["type"] == "external-push"
        assert trigger["metadata"]["scalerAddress"] == "scaler.test:9091"
        assert trigger["metadata"]["model"] == f"{wg.ns}/kd"
        assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (0, 3)
        dep = wg.apps.read_namespaced_deployment("wg-kd", wg.ns)
        assert dep.spec.replicas == 0
        assert condition(wg, "kd", "AutoscalingReady")["status"] == "True"
        wait_phase(wg, "kd", "Idle")

        saved = ext.read_custom_resource_definition(KEDA_CRD)
        crd_body = wg.api.sanitize_for_serialization(saved)
        for key in ("resourceVersion", "uid", "creationTimestamp", "managedFields", "generation"):
            crd_body["metadata"].pop(key, None)
        crd_body.pop("status", None)
        ext.delete_custom_resource_definition(KEDA_CRD)
        try:
            wait_for(lambda: _gone(lambda: ext.read_custom_resource_definition(KEDA_CRD)), 30, "KEDA CRD deleted")
            apply(wg, model_yaml("nokeda", scaling={"min": 1}))
            apply(wg, model_yaml("fallback", scaling={"min": 1, "engine": "builtin"}))
            wait_for(
                lambda: condition(wg, "nokeda", "AutoscalingReady").get("reason") == "ScaledObjectCRDMissing",
                30,
                "AutoscalingReady=False ScaledObjectCRDMissing",
            )
            assert condition(wg, "nokeda", "AutoscalingReady")["status"] == "False"
            wait_phase(wg, "fallback", "Ready")
            assert _gone(lambda: wg.apps.read_namespaced_deployment("wg-nokeda", wg.ns))
            print(kubectl(wg, "get", "models").stdout)
        finally:
            if _gone(lambda: ext.read_custom_resource_definition(KEDA_CRD)):
                ext.create_custom_resource_definition(crd_body)
            wait_for(lambda: not _gone(lambda: ext.read_custom_resource_definition(KEDA_CRD)), 30, "KEDA CRD back")
        wait_for(lambda: _exists(wg, "wg-nokeda"), 60, "Deployment once KEDA is installed again")


def test_keda_objects_follow_the_spec_and_go_when_the_engine_changes(wg: Kube, tmp_path: Path) -> None:
    """ScaledObject + TriggerAuthentication (`--keda-auth-secret`), owned by the Model, accepted by
    KEDA's real CRD schemas, updated with the spec and deleted when the engine becomes builtin."""
    args = ("--scaler-address", "scaler.test:9091", "--keda-auth-secret", "keda-client")
    with running(operator(wg, tmp_path, "operator", *args)):
        apply(wg, model_yaml("kf", scaling={"min": 0, "max": 2, "idleTimeout": 60}))
        so: dict[str, Any] = wait_for(lambda: _scaled_object(wg, "wg-kf") or {}, 30, "ScaledObject wg-kf")
        uid = get_model(wg, "kf")["metadata"]["uid"]
        auth = wg.custom.get_namespaced_custom_object("keda.sh", "v1alpha1", wg.ns, "triggerauthentications", "wg-kf")
        for obj in (so, auth):
            assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
        assert {ref["name"] for ref in auth["spec"]["secretTargetRef"]} == {"keda-client"}
        assert so["spec"]["triggers"][0]["authenticationRef"] == {"name": "wg-kf"}
        assert (so["spec"]["cooldownPeriod"], so["spec"]["pollingInterval"]) == (0, 6)
        apply(wg, model_yaml("kf", scaling={"min": 0, "max": 4, "idleTimeout": 60}))
        wait_for(lambda: (_scaled_object(wg, "wg-kf") or {}).get("spec", {}).get("maxReplicaCount") == 4,
                 30, "ScaledObject updated to max 4")
        apply(wg, model_yaml("kf", scaling={"min": 0, "max": 4, "idleTimeout": 60, "engine": "builtin"}))
        wait_for(lambda: _scaled_object(wg, "wg-kf") is None, 30, "ScaledObject deleted")
        assert _gone(lambda: wg.custom.get_namespaced_custom_object(
            "keda.sh", "v1alpha1", wg.ns, "triggerauthentications", "wg-kf"))
        assert _exists(wg, "wg-kf"), "the Deployment stays (now the builtin engine's)"


def _exists(kube: Kube, name: str) -> bool:
    return not _gone(lambda: kube.apps.read_namespaced_deployment(name, kube.ns))


def _scaled_object(kube: Kube, name: str) -> dict[str, Any] | None:
    try:
        body: dict[str, Any] = kube.custom.get_namespaced_custom_object(
            "keda.sh", "v1alpha1", kube.ns, "scaledobjects", name
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return body


def _holder(kube: Kube) -> str:
    try:
        lease = client.CoordinationV1Api(kube.api).read_namespaced_lease("wakegate-operator", kube.ns)
    except ApiException:
        return ""
    return str(lease.spec.holder_identity or "")


def test_standby_operator_takes_over_when_the_leader_is_killed(wg: Kube, tmp_path: Path) -> None:
    lease = ("--lease-seconds", "5")
    first = operator(wg, tmp_path, "op-a", *lease)
    second = operator(wg, tmp_path, "op-b", *lease)
    with running(first):
        wait_for(lambda: _holder(wg) == "op-a", 20, "op-a to lead")
        with running(second):
            apply(wg, model_yaml("one", scaling={"engine": "builtin"}))
            wait_phase(wg, "one", "Ready")
            assert _holder(wg) == "op-a"
            assert "is the leader" not in Path(tmp_path / "op-b.log").read_text()
            os.killpg(first.proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            apply(wg, model_yaml("two", scaling={"engine": "builtin"}))
            wait_for(lambda: _exists(wg, "wg-two"), 5 + 15, "the standby to reconcile a new Model")
            took = time.monotonic() - killed
            assert _holder(wg) == "op-b"
            wait_phase(wg, "two", "Ready")
            print(f"standby reconciled a new Model {took:.1f}s after the leader was killed (lease 5s)")
            assert took < 5 + 2 + 5, took


def test_shipped_runtimes_are_installed_and_selected_with_the_documented_rbac(wg: Kube, tmp_path: Path) -> None:
    with (
        scoped_kubeconfig(wg, tmp_path, "operator", OPERATOR_RULES, LEASE_RULES) as kubeconfig,
        running(Operator(tmp_path, kubeconfig, wg.ns, "operator", ["--renew-seconds", "1"])),
    ):
        apply(wg, model_yaml("picked", scaling={"engine": "builtin", "min": 0}))
        wait_phase(wg, "picked", "Idle")
        runtimes = kubectl(wg, "get", "inferenceruntimes", "-o", "json").stdout
        names = {item["metadata"]["name"] for item in json.loads(runtimes)["items"]}
        assert {"sim", "vllm-cuda", "vllm-rocm", "llamacpp", "llamacpp-cuda", "ollama"} <= names
        dep = wg.apps.read_namespaced_deployment("wg-picked", wg.ns)
        container = dep.spec.template.spec.containers[0]
        assert container.image == "ghcr.io/wakegate/sim:latest"
        assert container.readiness_probe.http_get.path == "/health"
        assert dep.spec.template.metadata.annotations["wakegate.io/backend"] == "sim"
        assert dep.metadata.owner_references[0].kind == "Model"
        log = (tmp_path / "operator.log").read_text()
        assert "Forbidden" not in log, log[-3000:]


def _proc_usage(pid: int) -> tuple[float, int]:
    """(CPU seconds, RSS bytes) of one process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    return cpu, rss


@pytest.mark.skipif(
    not os.environ.get("WAKEGATE_E2E_OPERATOR_MODELS"),
    reason="scale run: set WAKEGATE_E2E_OPERATOR_MODELS=200 (starts that many simulator pods)",
)
def test_many_models_reconcile_to_ready(wg: Kube, tmp_path: Path) -> None:
    count = int(os.environ["WAKEGATE_E2E_OPERATOR_MODELS"])
    op = operator(wg, tmp_path)
    with running(op):
        wait_for(lambda: _holder(wg) == "operator", 30, "the operator to lead")
        time.sleep(2)
        cpu0, _ = _proc_usage(op.proc.pid)
        docs = [
            model_yaml(f"m{i:03d}", scaling={"engine": "builtin"}, args=["--drain-seconds", "0"]) for i in range(count)
        ]
        started = time.monotonic()
        apply(wg, "---\n".join(docs))
        applied = time.monotonic() - started
        peak = 0

        def all_ready() -> bool:
            nonlocal peak
            peak = max(peak, _proc_usage(op.proc.pid)[1])
            items = wg.custom.list_namespaced_custom_object(GROUP, VERSION, wg.ns, "models")["items"]
            return bool(sum((m.get("status") or {}).get("phase") == "Ready" for m in items) == count)

        wait_for(all_ready, 900, f"{count} Models Ready", every=2)
        total = time.monotonic() - started
        cpu1, rss = _proc_usage(op.proc.pid)
        print(
            f"\n{count} Models: kubectl apply {applied:.1f}s, all Ready after {total:.1f}s; operator CPU "
            f"{cpu1 - cpu0:.1f}s, RSS {rss / 2**20:.0f} MiB (peak seen {max(peak, rss) / 2**20:.0f} MiB)"
        )
        idle0, _ = _proc_usage(op.proc.pid)
        time.sleep(30)
        idle1, _ = _proc_usage(op.proc.pid)
        print(f"operator CPU over the next 30 s idle: {idle1 - idle0:.2f}s")
        kubectl(wg, "delete", "models", "--all", "--wait=false")


def test_gpu_group_member_swapped_out_shows_preempted(wg: Kube, tmp_path: Path) -> None:
    """The scaler swaps group members by scaling them; here kubectl plays the scaler's part."""
    group = {"gpu": {"shared": "g"}, "args": ["--drain-seconds", "0"]}
    with running(operator(wg, tmp_path)):
        apply(wg, model_yaml("a", scaling={"engine": "builtin", "min": 1}, **group))
        apply(wg, model_yaml("b", scaling={"engine": "builtin", "min": 0}, **group))
        wait_phase(wg, "a", "Ready")
        wait_phase(wg, "b", "Idle")
        kubectl(wg, "scale", "deployment", "wg-b", "--replicas=1")
        kubectl(wg, "scale", "deployment", "wg-a", "--replicas=0")
        wait_phase(wg, "a", "Preempted")
        ready = condition(wg, "a", "Ready")
        assert ready["reason"] == "Preempted" and f"{wg.ns}/b" in ready["message"]
        assert get_model(wg, "a")["status"]["admitted"] is False
        wait_phase(wg, "b", "Ready")
        print(kubectl(wg, "get", "models").stdout)
        kubectl(wg, "scale", "deployment", "wg-b", "--replicas=0")
        wait_phase(wg, "a", "Idle")
        assert get_model(wg, "a")["status"]["admitted"] is True
