"""`wakegate scaler` on the real control plane: a `min: 0` Model goes 0 -> 1 -> 0 on a cold request.

The tests create what the operator would render (the Model, its `wg-<model>` Deployment at 0
replicas and Service, and for KEDA a ScaledObject with an `external-push` trigger) and run, as
local processes with the admin kubeconfig: `wakegate scaler`, `wakegate xds` (EndpointSlices ->
routes), extproc reporting demand to the scaler with a token, and Envoy. A cold request through
Envoy wakes the model, is answered once the pod is ready, and the Deployment goes back to 0
after idling:

* builtin engine: the scaler itself PATCHes the Deployment's scale subresource;
* KEDA: the real KEDA operator (built from its Go module by e2e/keda/build.sh into
  e2e/.bin/keda-operator; skipped when absent) talks to the scaler over external-push, through
  the objects the operator renders for a `keda` Model (control/operator/render.py).
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from e2e import kedaprocs
from e2e.cluster import Cluster
from e2e.helpers import Kube
from e2e.procs import Proc, stop_all
from tests.support.required import missing
from tests.support.waiting import wait_for
from wakegate.control import bootstrap
from wakegate.control.admin import free_port
from wakegate.control.bootstrap import envoy_binary
from wakegate.control.k8s import names
from wakegate.externalscaler import externalscaler_pb2, externalscaler_pb2_grpc

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


def model_name(ns: str) -> str:
    """Unique per test: `wakegate xds` routes every namespace, and a deleted namespace lingers."""
    return "lazy-" + ns.removeprefix("e2e-")



def serving(gw: Gateway) -> Iterator[Gateway]:
    """A fixture's body: the gateway started, handed to the test, stopped whatever happens."""
    gw.start()
    try:
        yield gw
    finally:
        gw.stop()

@pytest.fixture(scope="module")
def model_crd(cluster: Cluster) -> None:
    """The harness installs KEDA's CRDs only; the Model CRD comes from the chart."""
    with cluster.api_client() as api:
        ext = client.ApiextensionsV1Api(api)
        for path in sorted((REPO / "charts" / "wakegate" / "crds").glob("*.yaml")):
            body = yaml.safe_load(path.read_text())
            try:
                ext.create_custom_resource_definition(body)
            except ApiException as exc:
                if exc.status != 409:
                    raise

            def established(name: str = body["metadata"]["name"]) -> bool:
                crd = ext.read_custom_resource_definition(name)
                return any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or [])

            wait_for(established, 30, f"CRD {path.name} established")


def backend_objects(ns: str) -> tuple[dict[str, Any], dict[str, Any]]:
    model = model_name(ns)
    name = names.backend_name(model)
    labels = names.backend_labels(model)
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": names.selector_labels(model)},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [
                        {
                            "name": "backend",
                            "image": "ghcr.io/wakegate/sim:latest",
                            "args": ["--served-model-name", model, "--startup-seconds", "0.5"],
                            "ports": [{"name": "http", "containerPort": 8000}],
                            "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 1},
                        }
                    ],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {
            "selector": names.selector_labels(model),
            "ports": [{"name": "http", "port": 8000, "targetPort": 8000}],
        },
    }
    return deployment, service


class Gateway:
    """scaler + xds feeder + extproc + Envoy, as local processes."""

    def __init__(self, cluster: Cluster, ns: str, tmp: Path) -> None:
        self.tmp = tmp
        self.token = tmp / "token"
        self.token.write_text("e2e-internal-token\n")
        self.token.chmod(0o600)
        self.port = free_port()
        self.demand = f"127.0.0.1:{free_port()}"
        self.keda = f"127.0.0.1:{free_port()}"
        self.scaler_admin = f"127.0.0.1:{free_port()}"
        xds = free_port()
        extproc, extproc_admin, activator, envoy_admin = (free_port() for _ in range(4))
        kubeconfig = str(cluster.kubeconfig)
        py = [sys.executable, "-m"]
        node_id = f"e2e-gateway-{ns}"
        rendered = bootstrap.render(
            node_id,
            bootstrap.GatewayPorts(envoy_admin=envoy_admin, xds=xds, extproc=extproc, activator=activator),
            bootstrap.TokenRef(file=str(self.token)),
        )
        (tmp / "envoy.yaml").write_text(rendered)
        self.scaler = Proc(
            "scaler",
            [
                *py,
                "wakegate",
                "scaler",
                "--kubeconfig",
                kubeconfig,
                "--namespace",
                ns,
                "--lease-namespace",
                ns,
                "--demand-listen",
                self.demand,
                "--keda-listen",
                self.keda,
                "--admin-listen",
                self.scaler_admin,
                "--internal-token-file",
                str(self.token),
            ],
            tmp / "scaler.log",
        )
        self.procs = [
            self.scaler,
            Proc(
                "xds",
                [
                    *py,
                    "wakegate",
                    "xds",
                    "--kubeconfig",
                    kubeconfig,
                    "--listen",
                    f"127.0.0.1:{xds}",
                    "--gateway-listen",
                    f"127.0.0.1:{self.port}",
                    "--internal-token-file",
                    str(self.token),
                ],
                tmp / "xds.log",
            ),
            Proc(
                "extproc",
                [
                    *py,
                    "wakegate.extproc",
                    "--listen",
                    f"127.0.0.1:{extproc}",
                    "--admin-listen",
                    f"127.0.0.1:{extproc_admin}",
                    "--activator-listen",
                    f"127.0.0.1:{activator}",
                    "--xds",
                    f"127.0.0.1:{xds}",
                    "--demand",
                    self.demand,
                    "--internal-token-file",
                    str(self.token),
                    "--gateway-id",
                    node_id,
                ],
                tmp / "extproc.log",
            ),
            Proc(
                "envoy",
                [
                    envoy_binary(),
                    "-c",
                    str(tmp / "envoy.yaml"),
                    "--concurrency",
                    "1",
                    "--use-dynamic-base-id",
                    "--log-level",
                    "warn",
                ],
                tmp / "envoy.log",
            ),
        ]

    def start(self) -> None:
        for proc in self.procs:
            proc.start()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.tail(40)}" for p in self.procs)

    def stop(self) -> None:
        stop_all(self.procs, 5.0)


def create_model(kube: Kube, engine: str, scaler_address: str) -> None:
    """The Model and what it owns. For KEDA, exactly what the operator renders (Deployment,
    Service, ScaledObject with the scaler's address); for the builtin engine a lean Deployment."""
    model = {
        "apiVersion": names.API_VERSION,
        "kind": "Model",
        "metadata": {"name": model_name(kube.ns), "namespace": kube.ns},
        "spec": {
            "backend": "sim",
            "scaling": {"min": 0, "max": 1, "idleTimeout": 3, "activationTimeout": 60, "engine": engine},
        },
    }
    created = kube.custom.create_namespaced_custom_object(
        names.GROUP, names.VERSION, kube.ns, names.MODEL_PLURAL, model
    )
    if engine == "keda":
        from wakegate.control.k8s.objects import runtime_from_object
        from wakegate.control.operator import render
        from wakegate.control.runtimes import shipped_runtimes

        runtime = runtime_from_object(next(r for r in shipped_runtimes() if r["metadata"]["name"] == "sim"))
        settings = render.Settings(scaler_address=scaler_address)
        for obj in render.render(created, runtime, settings, initial_replicas=0).objects:
            if obj["kind"] == "Deployment":
                kube.apps.create_namespaced_deployment(kube.ns, obj)
            elif obj["kind"] == "Service":
                kube.core.create_namespaced_service(kube.ns, obj)
            else:
                kube.custom.create_namespaced_custom_object("keda.sh", "v1alpha1", kube.ns, "scaledobjects", obj)
        return
    deployment, service = backend_objects(kube.ns)
    kube.apps.create_namespaced_deployment(kube.ns, deployment)
    kube.core.create_namespaced_service(kube.ns, service)


@pytest.fixture
def gateway(kube: Kube, model_crd: None, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Gateway]:
    gw = Gateway(kube.cluster, kube.ns, tmp_path)
    create_model(kube, getattr(request, "param", "builtin"), gw.keda)
    yield from serving(gw)


def chat(url: str, model: str, out: list[tuple[int, str, float]], timeout: float = 90) -> None:
    import urllib.error
    import urllib.request

    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    req = urllib.request.Request(url, data=body, headers={"content-type": "application/json"}, method="POST")
    start = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            out.append((resp.status, resp.read().decode(), time.monotonic() - start))
    except urllib.error.HTTPError as exc:
        out.append((exc.code, exc.read().decode(), time.monotonic() - start))


def replicas(kube: Kube) -> int:
    return int(
        kube.apps.read_namespaced_deployment_scale(names.backend_name(model_name(kube.ns)), kube.ns).spec.replicas or 0
    )


def cold_round_trip(
    kube: Kube, gateway: Gateway, idle_within: float, answer_within: float = 90
) -> tuple[float, float]:
    """Cold request through the gateway: 0 -> 1, answered, back to 0. Returns (answer s, idle s)."""
    model = model_name(kube.ns)
    ref = externalscaler_pb2.ScaledObjectRef(name=names.backend_name(model), namespace=kube.ns)
    with grpc.insecure_channel(gateway.keda) as channel:
        stub = externalscaler_pb2_grpc.ExternalScalerStub(channel)

        def scaler_knows_model() -> bool:
            try:
                return stub.IsActive(ref, timeout=2).result is False
            except grpc.RpcError:
                return False

        wait_for(scaler_knows_model, 60, f"scaler serving the Model\n{gateway.logs()}")
        # The gateway serves and its extproc knows the Model (its routes come from the feeder,
        # which may learn of the Model after the scaler did): a request now holds and wakes it.
        wait_for(
            lambda: _lists(f"http://127.0.0.1:{gateway.port}/v1/models", model), 60, f"gateway up\n{gateway.logs()}"
        )
        assert replicas(kube) == 0

        results: list[tuple[int, str, float]] = []
        worker = threading.Thread(
            target=chat,
            args=(f"http://127.0.0.1:{gateway.port}/v1/chat/completions", model, results, answer_within),
        )
        worker.start()
        wait_for(lambda: replicas(kube) == 1, 10, f"Deployment scaled 0 -> 1\n{gateway.logs()}")
        assert stub.IsActive(ref).result is True
        worker.join(answer_within)
        assert results and results[0][0] == 200, f"{results}\n{gateway.logs()}"
        idle_from = time.monotonic()
        wait_for(lambda: replicas(kube) == 0, idle_within + 10, f"Deployment back to 0\n{gateway.logs()}")
        idle = time.monotonic() - idle_from
        assert stub.IsActive(ref).result is False
        wait_for(lambda: not kube.pods(names.LABEL_MODEL + "=" + model), 30, "backend pod gone")
        return results[0][2], idle


def test_builtin_engine_scales_from_zero_and_back(kube: Kube, gateway: Gateway) -> None:
    leader = wait_for(
        lambda: "wakegate_scaler_leader 1.0" in _get(f"http://{gateway.scaler_admin}/metrics"), 30, "lease"
    )
    assert leader
    answered, idle = cold_round_trip(kube, gateway, idle_within=12)
    # The gateway's activation lease outlives readiness by its grace (extproc/cold.py, 5 s); then
    # idleTimeout (3 s) without demand -> back to 0, about 8 s after the answer.
    assert 5.0 < idle < 12.0, f"scaled to zero after {idle:.1f}s"
    assert "wakegate_scaler_scale_patches_total" in _get(f"http://{gateway.scaler_admin}/metrics")
    print(f"builtin: cold request answered in {answered:.2f}s; scaled to zero {idle:.1f}s after it")


@pytest.fixture
def keda(kube: Kube, tmp_path: Path) -> Iterator[Proc]:
    """KEDA's operator, watching the test namespace only, with the admin kubeconfig."""
    if not kedaprocs.OPERATOR_BIN.exists():
        missing("e2e/.bin/keda-operator is not built (run e2e/keda/build.sh)")
    kedaprocs.prepare(kube.api)
    # Its metrics gRPC service (for KEDA's metrics adapter, not run here) needs a cert in --cert-dir.
    pki = kedaprocs.certificates(tmp_path / "keda-certs")
    proc, _ = kedaprocs.operator(kube.cluster, kube.ns, pki.dir, tmp_path / "keda.log")
    proc.start()
    try:
        kedaprocs.wait_operator(proc)
        yield proc
    finally:
        proc.stop()
        shutil.rmtree(pki.dir, ignore_errors=True)


@pytest.mark.parametrize("gateway", ["keda"], indirect=True)
def test_keda_operator_scales_from_zero_and_back(kube: Kube, gateway: Gateway, keda: Proc) -> None:
    """The operator's ScaledObject (rendered by control/operator/render.py, as the operator applies
    it): KEDA scales 0 -> 1 on a cold request and back to 0 after wakegate's idle alone."""
    model = model_name(kube.ns)

    def ready() -> bool:
        obj = kube.custom.get_namespaced_custom_object(
            "keda.sh", "v1alpha1", kube.ns, "scaledobjects", names.backend_name(model)
        )
        conditions = {c["type"]: c["status"] for c in (obj.get("status") or {}).get("conditions") or []}
        return conditions.get("Ready") == "True"

    wait_for(ready, 60, f"ScaledObject Ready\n{keda.tail(40)}")
    # KEDA holds a StreamIsActive stream open to the scaler (external-push) ...
    metrics = f"http://{gateway.scaler_admin}/metrics"
    wait_for(lambda: "wakegate_scaler_streams 1.0" in _get(metrics), 30, "KEDA's StreamIsActive stream")
    # ... and built its HPA from GetMetricSpec: targetInFlight (default 8) per replica, with the
    # builtin engine's scale-in window.
    autoscaling = client.AutoscalingV2Api(kube.api)
    hpas = wait_for(lambda: autoscaling.list_namespaced_horizontal_pod_autoscaler(kube.ns).items, 30, "HPA")
    hpa = hpas[0]
    target = hpa.spec.metrics[0].external.target
    assert (target.type, target.average_value) == ("AverageValue", "8")
    assert hpa.spec.behavior.scale_down.stabilization_window_seconds == 30
    answered, idle = cold_round_trip(kube, gateway, idle_within=12)
    # Lease grace (5 s) + idleTimeout (3 s), as with the builtin engine: cooldownPeriod 0 adds no
    # second idle period (KEDA acts on StreamIsActive's `false` at once).
    assert 5.0 < idle < 12.0, f"scaled to zero after {idle:.1f}s"
    print(f"KEDA: cold request answered in {answered:.2f}s; scaled to zero {idle:.1f}s after it")


def _get(url: str) -> str:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return str(resp.read().decode())
    except OSError:
        return ""


def _lists(url: str, model: str) -> bool:
    """Whether GET `url` (an OpenAI model list) answers 200 and names `model`."""
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200 and model in {m.get("id") for m in json.load(resp).get("data", [])}
    except (OSError, ValueError):
        return False



def test_lease_elects_one_scaler_and_hands_over(kube: Kube) -> None:
    """Only one builtin engine acts: two candidates, one holder; the other takes over on release."""
    from wakegate.control.k8s import client as seam
    from wakegate.control.scaler.lease import LeaseElector

    changes: list[tuple[str, bool]] = []
    api = seam.Kube(kube.api)
    a = LeaseElector(api, kube.ns, "wakegate-scaler", "a", lambda v: changes.append(("a", v)), lease_seconds=3)
    b = LeaseElector(api, kube.ns, "wakegate-scaler", "b", lambda v: changes.append(("b", v)), lease_seconds=3)
    assert a.try_acquire() is True
    assert b.try_acquire() is False
    assert a.try_acquire() is True, "the holder renews"
    a.release()
    assert b.try_acquire() is True, "a released Lease is free at once"
    assert a.try_acquire() is False
    # A holder that stops renewing loses the Lease after lease_seconds.
    time.sleep(3.5)
    assert a.try_acquire() is True
    lease = client.CoordinationV1Api(kube.api).read_namespaced_lease("wakegate-scaler", kube.ns)
    assert lease.spec.holder_identity == "a" and lease.spec.lease_transitions == 2


def create_llama_model(kube: Kube, gguf: Path) -> None:
    """A llama.cpp Model on a GGUF the node reads through a hostPath volume; its Deployment and
    Service are what the operator renders from the shipped `llamacpp` InferenceRuntime."""
    from wakegate.control.runtimes import shipped_runtimes

    spec = {
        "backend": "llamacpp",
        "source": f"file://{gguf}",
        "args": ["--threads", "1", "--ctx-size", "512"],
        "scaling": {"min": 0, "max": 1, "idleTimeout": 3, "activationTimeout": 90, "engine": "builtin"},
    }
    create_rendered_model(kube, spec, next(r for r in shipped_runtimes() if r["metadata"]["name"] == "llamacpp"))


def create_rendered_model(kube: Kube, spec: dict[str, Any], runtime_object: dict[str, Any]) -> None:
    """A Model with `spec`, and the Deployment and Service the operator renders for it from
    `runtime_object` (an InferenceRuntime), created at 0 replicas."""
    from wakegate.control.k8s.objects import runtime_from_object
    from wakegate.control.operator import render

    model = {
        "apiVersion": names.API_VERSION,
        "kind": "Model",
        "metadata": {"name": model_name(kube.ns), "namespace": kube.ns},
        "spec": spec,
    }
    created = kube.custom.create_namespaced_custom_object(
        names.GROUP, names.VERSION, kube.ns, names.MODEL_PLURAL, model
    )
    runtime = runtime_from_object(runtime_object)
    rendered = render.render(created, runtime, render.Settings(keda_available=False), initial_replicas=0)
    for obj in rendered.objects:
        if obj["kind"] == "Deployment":
            kube.apps.create_namespaced_deployment(kube.ns, obj)
        elif obj["kind"] == "Service":
            kube.core.create_namespaced_service(kube.ns, obj)


@pytest.fixture
def llama_gateway(kube: Kube, model_crd: None, tmp_path: Path) -> Iterator[Gateway]:
    from e2e import engines
    from e2e.tinymodel import ModelSpec, write_model

    try:
        engines.ensure("llama-server")
    except engines.ToolchainMissing as exc:
        missing(str(exc))
    weights = tmp_path / "weights"
    weights.mkdir()
    create_llama_model(kube, write_model(weights / "tiny.gguf", ModelSpec()))
    yield from serving(Gateway(kube.cluster, kube.ns, tmp_path))


def test_llamacpp_model_scales_from_zero_answers_and_goes_back(kube: Kube, llama_gateway: Gateway) -> None:
    """The real engine as a pod: llama-server loads the GGUF from its hostPath volume, is Ready only
    once /health says the model is loaded, answers through the cluster gateway, and goes away."""
    answered, idle = cold_round_trip(kube, llama_gateway, idle_within=15)
    print(f"llamacpp: cold request answered in {answered:.2f}s; scaled to zero {idle:.1f}s after it")


@pytest.fixture
def vllm_gateway(kube: Kube, model_crd: None, tmp_path: Path) -> Iterator[Gateway]:
    from e2e import engines, hfmodel
    from wakegate.control.backends import BACKENDS, Image
    from wakegate.control.runtimes import runtime_for

    engines.ensure("vllm")
    folder = hfmodel.write_model(tmp_path / "weights" / "tiny")
    spec = {
        "backend": "vllm",
        "source": f"file://{folder}",
        "args": ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager"],
        "scaling": {"min": 0, "max": 1, "idleTimeout": 3, "activationTimeout": 300, "engine": "builtin"},
    }
    # vLLM's runtime as the plugin renders it, for a CPU image (the shipped ones are CUDA and ROCm).
    create_rendered_model(kube, spec, runtime_for(BACKENDS["vllm"], Image("cpu", "vllm/vllm-openai:latest")))
    yield from serving(Gateway(kube.cluster, kube.ns, tmp_path))


def test_vllm_model_scales_from_zero_answers_and_goes_back(kube: Kube, vllm_gateway: Gateway) -> None:
    """Real vLLM as a pod: it loads the generated folder from its hostPath volume, is Ready once
    /health says the model is loaded, answers through the cluster gateway, and goes away."""
    answered, idle = cold_round_trip(kube, vllm_gateway, idle_within=45, answer_within=300)
    print(f"vllm: cold request answered in {answered:.2f}s; scaled to zero {idle:.1f}s after it")
