"""KEDA all the way on a chart install: 0 -> 1 -> N -> 1 -> 0 through a real HPA, with mTLS.

charts/wakegate is installed with the real Helm (as e2e/test_helm.py does, whose helpers this
reuses); the chart generates the scaler's mTLS material (CA, the scaler's server certificate,
KEDA's client certificate in the Models' namespace) and the operator writes each `keda` Model's
ScaledObject and TriggerAuthentication. Nothing KEDA acts on is written by the test.

KEDA runs as local processes (e2e/kedaprocs.py): its operator, which dials the scaler by its
Service name over mTLS (a private /etc/hosts stands in for cluster DNS), and its metrics API
server registered as `v1beta1.external.metrics.k8s.io`, which the HPA controller of the
harness's kube-controller-manager (sync every 2 s) reads for 1 -> N and N -> 1.

Own cluster (module scope), like test_helm.py: the chart's components watch cluster-wide.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from kubernetes import client

from e2e import kedaprocs
from e2e.cluster import Cluster
from e2e.helm import ensure_helm
from e2e.procs import Proc, stop_all
from e2e.test_helm import (
    BASE_VALUES,
    CHART,
    COMPONENTS,
    GROUP,
    NS,
    PREFIX,
    RELEASE,
    VERSION,
    chat,
    diagnostics,
    merged,
    ready_pod,
    run_helm,
    values_file,
)
from tests.support.required import missing
from tests.support.waiting import wait_for
from wakegate.externalscaler import externalscaler_pb2, externalscaler_pb2_grpc

pytestmark = pytest.mark.e2e

MODELS_NS = "keda-models"
MODEL = "busy"
MAX = 3
IDLE = 6
#: Each request takes this long in the simulator: a few clients keep several in flight.
TTFT_MS = 1500


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    for binary in (kedaprocs.OPERATOR_BIN, kedaprocs.ADAPTER_BIN):
        if not binary.exists():
            missing(f"{binary} is not built (e2e/keda/build.sh, e2e/keda/build.sh adapter)")
    own = Cluster(tmp_path_factory.mktemp("keda-cluster"), nodes=2)
    own.start()
    try:
        yield own
    finally:
        own.stop()


class Replicas:
    """Samples the Deployment's spec.replicas every 0.5 s: (seconds since start, replicas) on change;
    and what the scaler says of the model (its /metrics): (seconds, active, demand) on change."""

    def __init__(self, apps: client.AppsV1Api, name: str, scaler: str) -> None:
        self.apps, self.name, self.scaler = apps, name, scaler
        self.started = time.monotonic()
        self.series: list[tuple[float, int]] = []
        self.signals: list[tuple[float, bool, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        label = f'{{model="{MODELS_NS}/{MODEL}"}}'
        while not self._stop.wait(0.5):
            at = round(time.monotonic() - self.started, 1)
            values = {line.split(label)[0]: float(line.rsplit(" ", 1)[1])
                      for line in _metrics(self.scaler).splitlines() if label in line}
            if "wakegate_model_active" in values:
                signal = (values["wakegate_model_active"] == 1, int(values.get("wakegate_model_demand", 0)))
                if not self.signals or self.signals[-1][1:] != signal:
                    self.signals.append((at, *signal))
            try:
                count = int(self.apps.read_namespaced_deployment_scale(self.name, MODELS_NS).spec.replicas or 0)
            except client.ApiException:
                continue
            if not self.series or self.series[-1][1] != count:
                self.series.append((at, count))

    def now(self) -> int:
        return self.series[-1][1] if self.series else 0

    def reached(self, count: int) -> float:
        """Seconds since start at which `count` was first seen (after the last change away from it)."""
        return next(t for t, n in reversed(self.series) if n == count)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)


class Load:
    """`clients` threads sending chat requests back to back until stopped; counts the answers."""

    def __init__(self, url: str, clients: int) -> None:
        self.url = url
        self.codes: list[int] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.codes.append(chat(self.url, MODEL)[0])

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)


def _keda_object(custom: client.CustomObjectsApi, plural: str) -> dict[str, Any]:
    body: dict[str, Any] = custom.get_namespaced_custom_object("keda.sh", "v1alpha1", MODELS_NS, plural, f"wg-{MODEL}")
    return body


def test_chart_install_keda_model_scales_0_1_n_1_0_through_the_operators_objects(
    cluster: Cluster, tmp_path: Path
) -> None:
    helm = ensure_helm()
    procs: list[Proc] = []
    with cluster.api_client() as api:
        core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
        custom, autoscaling = client.CustomObjectsApi(api), client.AutoscalingV2Api(api)
        core.create_namespace({"metadata": {"name": MODELS_NS}})
        kedaprocs.prepare(api)
        try:
            with diagnostics(cluster, core):
                # 1. Chart install (gateway held until it knows the feeder's and scaler's pod IPs),
                #    with KEDA's client certificate generated into the Models' namespace.
                tls = {"scaler": {"tls": {"modelNamespaces": [MODELS_NS]}}}
                held = merged(BASE_VALUES, {"gateway": {"nodeSelector": {"wakegate.io/e2e": "after-upgrade"}}, **tls})
                run_helm(helm, cluster, "install", RELEASE, str(CHART), "--namespace", NS, "--create-namespace",
                         "-f", values_file(tmp_path, "install.yaml", held))
                for component in COMPONENTS:
                    wait_for(functools.partial(ready_pod, core, component), 120, f"a ready {component} pod", every=1)
                xds_ip = ready_pod(core, "xds").status.pod_ip
                scaler_ip = ready_pod(core, "scaler").status.pod_ip
                addressed = merged(BASE_VALUES, {"gateway": {"xdsHost": xds_ip, "scalerHost": scaler_ip}, **tls})
                run_helm(helm, cluster, "upgrade", RELEASE, str(CHART), "--namespace", NS, "--wait",
                         "--timeout", "120s", "-f", values_file(tmp_path, "upgrade.yaml", addressed))
                assert ready_pod(core, "scaler").status.pod_ip == scaler_ip, "the upgrade kept the scaler's certificate"
                gateway = wait_for(lambda: ready_pod(core, "gateway"), 30, "a ready gateway pod")
                url = f"http://{gateway.status.pod_ip}:8090"

                # The KEDA port refuses a client without KEDA's certificate.
                with grpc.insecure_channel(f"{scaler_ip}:9091") as channel, pytest.raises(grpc.RpcError):
                    externalscaler_pb2_grpc.ExternalScalerStub(channel).IsActive(
                        externalscaler_pb2.ScaledObjectRef(name=f"wg-{MODEL}", namespace=MODELS_NS), timeout=5)

                # 2. KEDA: its operator (the scaler's Service name resolves to the scaler pod for it
                #    alone) and its metrics API server behind the external metrics APIService.
                pki = kedaprocs.certificates(tmp_path / "keda-certs")
                operator, metrics_service = kedaprocs.operator(
                    cluster, MODELS_NS, pki.dir, tmp_path / "keda-operator.log",
                    hosts={f"{PREFIX}-scaler.{NS}.svc": scaler_ip})
                adapter, address, port = kedaprocs.adapter(
                    cluster, MODELS_NS, pki.dir, metrics_service, tmp_path / "keda-adapter.log")
                procs += [operator, adapter]
                operator.start()
                kedaprocs.wait_operator(operator)
                adapter.start()
                kedaprocs.register_adapter(api, address, port, pki.dir / "ca.crt")

                # 3. A keda Model: the operator writes its ScaledObject and TriggerAuthentication.
                custom.create_namespaced_custom_object(GROUP, VERSION, MODELS_NS, "models", {
                    "apiVersion": f"{GROUP}/{VERSION}", "kind": "Model", "metadata": {"name": MODEL},
                    "spec": {"backend": "sim", "args": ["--ttft-ms", str(TTFT_MS)],
                             "scaling": {"engine": "keda", "min": 0, "max": MAX, "idleTimeout": IDLE,
                                         "targetInFlight": 1, "activationTimeout": 60}},
                })
                so: dict[str, Any] = wait_for(lambda: _present(custom, "scaledobjects") or {}, 60,
                                              "the operator's ScaledObject")
                auth = _keda_object(custom, "triggerauthentications")
                model_uid = custom.get_namespaced_custom_object(
                    GROUP, VERSION, MODELS_NS, "models", MODEL)["metadata"]["uid"]
                for obj in (so, auth):
                    assert obj["metadata"]["ownerReferences"][0]["uid"] == model_uid
                    assert {e["manager"] for e in obj["metadata"]["managedFields"]} <= {
                        "wakegate-operator", "keda-operator", "keda"}, obj["metadata"]["managedFields"]
                assert so["spec"]["cooldownPeriod"] == 0
                assert so["spec"]["triggers"][0]["authenticationRef"] == {"name": f"wg-{MODEL}"}
                assert so["spec"]["triggers"][0]["metadata"]["scalerAddress"] == f"{PREFIX}-scaler.{NS}.svc:9091"

                def so_ready() -> bool:
                    conditions = {c["type"]: c["status"] for c in (_keda_object(custom, "scaledobjects")
                                                                   .get("status") or {}).get("conditions") or []}
                    return conditions.get("Ready") == "True"

                wait_for(so_ready, 90, f"ScaledObject Ready\n{operator.tail(40)}", every=1)
                wait_for(lambda: autoscaling.list_namespaced_horizontal_pod_autoscaler(MODELS_NS).items, 30,
                         "KEDA's HPA")
                # KEDA's stream to the scaler is up (over mTLS: nothing else gets through).
                wait_for(lambda: "wakegate_scaler_streams 1.0" in _metrics(scaler_ip), 60,
                         f"KEDA's StreamIsActive stream\n{operator.tail(40)}", every=1)
                assert not apps.read_namespaced_deployment_scale(f"wg-{MODEL}", MODELS_NS).spec.replicas

                # 4. 0 -> 1 on a request, answered.
                replicas = Replicas(apps, f"wg-{MODEL}", scaler_ip)
                status, body = chat(url, MODEL)
                assert status == 200, body
                woke = replicas.reached(1)

                # 5. 1 -> N: sustained load of MAX clients (each request 1.5 s) wants MAX replicas.
                load_started = time.monotonic() - replicas.started
                load = Load(url, MAX + 1)
                wait_for(lambda: replicas.now() == MAX, 120,
                         f"HPA scaling out to {MAX}: {replicas.series}\n{adapter.tail(30)}", every=1)
                out_at = replicas.reached(MAX)
                hpa = autoscaling.list_namespaced_horizontal_pod_autoscaler(MODELS_NS).items[0]
                assert hpa.status.current_metrics and hpa.status.current_metrics[0].external, hpa.status
                time.sleep(5)
                assert replicas.now() == MAX, replicas.series
                load.stop()

                # 6. N -> 1: one client left (demand 1) -> the HPA steps in after the scale-in window.
                one_started = time.monotonic() - replicas.started
                trickle = Load(url, 1)
                wait_for(lambda: replicas.now() == 1, 120, f"HPA scaling in to 1: {replicas.series}", every=1)
                in_at = replicas.reached(1)
                trickle.stop()

                # 7. 1 -> 0 once wakegate's idle timeout passed (KEDA adds no cooldown of its own).
                idle_started = time.monotonic() - replicas.started
                wait_for(lambda: replicas.now() == 0, IDLE + 30, f"back to 0: {replicas.series}", every=1)
                zero_at = replicas.reached(0)
                inactive_at = next(t for t, active, _ in replicas.signals if t >= idle_started and not active)
                replicas.stop()
                codes = [*load.codes, *trickle.codes]
                assert codes and set(codes) == {200}, codes
                figures = {
                    "woke (s after the first request)": woke,
                    "time to scale out to max (s from load)": round(out_at - load_started, 1),
                    "time to scale in to 1 (s from demand 1)": round(in_at - one_started, 1),
                    "time to zero (s from the last request)": round(zero_at - idle_started, 1),
                    "IsActive false (s from the last request)": round(inactive_at - idle_started, 1),
                    "requests answered under load": len(codes),
                }
                print("KEDA HPA figures:", figures)
                print("replicas over time (s, replicas):", replicas.series)
                print("the scaler's view (s, active, demand):", replicas.signals)
                # The scale-in window (30 s) applies to N -> 1; idling is wakegate's alone:
                # idleTimeout, then KEDA's next poll (pollingInterval 1 s here), not 2x idleTimeout.
                assert 25 <= in_at - one_started <= 75, replicas.series
                assert IDLE - 1 <= inactive_at - idle_started <= IDLE + 4, replicas.signals
                assert zero_at - inactive_at <= 4, (replicas.series, replicas.signals)
        finally:
            stop_all(procs, 5.0)
            for proc in procs:
                print(f"----- {proc.name}\n{proc.tail(30)}")


def _present(custom: client.CustomObjectsApi, plural: str) -> dict[str, Any] | None:
    try:
        return _keda_object(custom, plural)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def _metrics(host: str) -> str:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{host}:8080/metrics", timeout=2) as resp:
            return str(resp.read().decode())
    except OSError:
        return ""
