"""Observability and security of a chart install, on the real control plane.

One install of charts/wakegate (the gateway held, then addressed, as in e2e/test_helm.py) with
scoped API keys from a Secret, four Models (`warm`, `cold`, and `g1`/`g2` sharing a GPU group), and
a real Prometheus (Debian's `prometheus`) that scrapes what the chart's ServiceMonitors and
PodMonitors select. There is no Prometheus Operator here, so the test does its part: it renders
the chart's monitors (`helm template` with the monitoring API versions), resolves each endpoint
against the live Services and Pods (selectors, named ports) into file service discovery targets
that carry the `__meta_kubernetes_*` labels Kubernetes discovery would, and hands Prometheus the
monitors' own relabelings. So the PodMonitor's `wakegate.io/metrics-path` annotation, the operator's
metrics port and the gateway's two endpoints are what is proven, not a hand-written target list.

Then, in order:
1. a demand report to the scaler without the internal token is refused (UNAUTHENTICATED), counted
   (`wakegate_internal_auth_refused_total{service="demand"}`, and the alert fires), and `cold`
   stays at zero replicas;
2. a key scoped to `warm` gets 404 model_not_found for `cold` and sees only `warm` in /v1/models,
   and the gateway's port has no /metrics (the chart's default);
3. the dashboards' workload (tests/support/prometheus.py: streaming requests, a rate-limit
   rejection, a cold start with a queue overflow, a GPU-group swap), after which every panel of
   every dashboard returns data and every alert rule evaluates: the same verdict as for `wakegate up`;
4. with llama-server built, a llama.cpp Model: scraped at its runtime's metrics path, its `llamacpp:`
   series in the Model dashboard's engine panels.

Own cluster (module scope), as for test_helm: the chart's components watch cluster-wide.
"""

from __future__ import annotations

import base64
import functools
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from kubernetes import client

from dashboards.definitions import MODEL
from dashboards.grafana import expand
from e2e import engines
from e2e.cluster import Cluster
from e2e.helm import ensure_helm
from e2e.test_helm import (
    BASE_VALUES,
    CHART,
    COMPONENTS,
    MODELS_NS,
    NS,
    RELEASE,
    diagnostics,
    merged,
    ready_pod,
    run_helm,
    values_file,
)
from e2e.tinymodel import ModelSpec, write_model
from tests.support.http import request
from tests.support.prometheus import (
    MISSING,
    Prometheus,
    assert_every_panel_returns_data_and_every_alert_evaluates,
    available,
    file_sd,
    workload,
)
from tests.support.required import missing
from tests.support.waiting import wait_for
from wakegate.v1 import demand_pb2, demand_pb2_grpc

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True, scope="module")
def _prometheus_installed() -> None:
    if not available():
        missing(MISSING)


GROUP, VERSION = "wakegate.io", "v1alpha1"
ALL_KEY, WARM_KEY = "sk-e2e-everything-0123", "sk-e2e-warm-only-4567"
#: A gateway-wide key, and one scoped to `warm` (by the Model's name; its key `models/warm` works too).
KEYS = f"{ALL_KEY}\n{WARM_KEY}  warm\n"
MONITORING = ("--api-versions", "monitoring.coreos.com/v1/ServiceMonitor",
              "--api-versions", "monitoring.coreos.com/v1/PodMonitor")
GROUP_SPEC = {"shared": "gpu0", "minRunSeconds": 0, "swapCooldownSeconds": 0, "demandWindowSeconds": 0}
MODELS: dict[str, dict[str, Any]] = {
    "warm": {"args": ["--ttft-ms", "20", "--tokens-per-second", "400"],
             "scaling": {"min": 1, "max": 1, "engine": "builtin"},
             "limits": {"requestsPerSecond": 2, "burst": 4},
             "flowControl": {"enabled": True, "saturation": {"maxInFlight": 1}}},
    "cold": {"args": ["--startup-seconds", "1.5"],
             "scaling": {"min": 0, "max": 1, "idleTimeout": 300, "activationTimeout": 90, "engine": "builtin"},
             "endpoint": {"maxQueue": 1}},
    **{name: {"args": ["--startup-seconds", "0.3"],
              "scaling": {"min": 0, "max": 1, "idleTimeout": 300, "activationTimeout": 90, "engine": "builtin"},
              "gpu": GROUP_SPEC}
       for name in ("g1", "g2")},
}


#: A real llama.cpp server on a generated GGUF (when e2e/.bin has it built): its pods' metrics
#: path comes from the shipped `llamacpp` InferenceRuntime.
LLAMA = engines.ENGINES["llama-server"].is_current()


def llama_model(gguf: Path) -> dict[str, Any]:
    return {"backend": "llamacpp", "source": f"file://{gguf}", "args": ["--threads", "1", "--ctx-size", "512"],
            "scaling": {"min": 1, "max": 1, "engine": "builtin"}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    own = Cluster(tmp_path_factory.mktemp("obs-cluster"), nodes=2)
    own.start()
    try:
        yield own
    finally:
        own.stop()


# -- the chart's monitors, as the Prometheus Operator would turn them into scrape configs ---------

def _meta_name(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


def _pod_meta(pod: Any) -> dict[str, str]:
    """The `__meta_kubernetes_*` labels Kubernetes service discovery gives a pod target."""
    meta = {"__meta_kubernetes_namespace": pod.metadata.namespace, "__meta_kubernetes_pod_name": pod.metadata.name}
    for key, value in (pod.metadata.labels or {}).items():
        meta[f"__meta_kubernetes_pod_label_{_meta_name(key)}"] = value
    for key, value in (pod.metadata.annotations or {}).items():
        meta[f"__meta_kubernetes_pod_annotation_{_meta_name(key)}"] = value
        meta[f"__meta_kubernetes_pod_annotationpresent_{_meta_name(key)}"] = "true"
    return meta


def _container_port(pod: Any, port: str | int) -> int | None:
    for container in pod.spec.containers:
        for p in container.ports or []:
            if p.name == port or p.container_port == port:
                return int(p.container_port)
    return None


def _selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def _live(pods: list[Any]) -> list[Any]:
    return [p for p in pods if p.status.pod_ip and not p.metadata.deletion_timestamp]


def _relabelings(endpoint: dict[str, Any]) -> list[dict[str, Any]]:
    """A monitor's relabelings in Prometheus's own spelling (after the operator's default ones)."""
    spelled = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    defaults = [
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
    ]
    return defaults + [{spelled.get(k, k): v for k, v in r.items()} for r in endpoint.get("relabelings") or []]


class Monitors:
    """Scrape jobs from the chart's ServiceMonitors and PodMonitors; `refresh()` re-resolves their
    targets against the cluster (pods come and go as models wake and idle)."""

    def __init__(self, docs: list[dict[str, Any]], core: client.CoreV1Api) -> None:
        self.core = core
        #: job name -> (kind, monitor spec, endpoint)
        self.jobs = {
            f"{doc['kind']}/{doc['metadata']['name']}/{i}": (doc["kind"], doc["spec"], endpoint)
            for doc in docs
            if doc["kind"] in ("ServiceMonitor", "PodMonitor")
            for i, endpoint in enumerate(doc["spec"].get("endpoints") or doc["spec"].get("podMetricsEndpoints") or [])
        }
        self.prom: Prometheus | None = None
        self._lock = threading.Lock()  # the resolver thread and the test both refresh

    def scrape_configs(self, tmp: Path) -> list[dict[str, Any]]:
        return [
            {"job_name": job, "metrics_path": endpoint.get("path", "/metrics"),
             "file_sd_configs": file_sd(tmp, self._file(job)), "relabel_configs": _relabelings(endpoint)}
            for job, (_, _, endpoint) in self.jobs.items()
        ]

    @staticmethod
    def _file(job: str) -> str:
        return _meta_name(job)

    def _namespaces(self, spec: dict[str, Any]) -> list[str] | None:
        selector = spec.get("namespaceSelector") or {}
        return None if selector.get("any") else list(selector.get("matchNames") or [NS])

    def _pods(self, namespaces: list[str] | None, labels: dict[str, str]) -> list[Any]:
        selector = _selector(labels)
        if namespaces is None:
            return _live(self.core.list_pod_for_all_namespaces(label_selector=selector).items)
        return [p for ns in namespaces for p in _live(self.core.list_namespaced_pod(ns, label_selector=selector).items)]

    def targets(self, kind: str, spec: dict[str, Any], endpoint: dict[str, Any]) -> list[dict[str, Any]]:
        namespaces = self._namespaces(spec)
        labels = spec["selector"]["matchLabels"]
        found: list[tuple[Any, str | int]] = []
        if kind == "PodMonitor":
            found = [(pod, endpoint["port"]) for pod in self._pods(namespaces, labels)]
        else:
            for ns in namespaces or []:
                for svc in self.core.list_namespaced_service(ns, label_selector=_selector(labels)).items:
                    port = next((p for p in svc.spec.ports if p.name == endpoint["port"]), None)
                    if port is not None:
                        found += [(pod, port.target_port) for pod in self._pods([ns], svc.spec.selector)]
        out = []
        for pod, port in found:
            number = _container_port(pod, port)
            if number is not None:
                out.append({"targets": [f"{pod.status.pod_ip}:{number}"], "labels": _pod_meta(pod)})
        return out

    def refresh(self) -> None:
        assert self.prom is not None
        with self._lock:
            for job, (kind, spec, endpoint) in self.jobs.items():
                self.prom.file_targets(self._file(job), self.targets(kind, spec, endpoint))


@pytest.fixture(scope="module")
def install(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The chart installed with scoped keys and the four Models Ready or Idle; yields addresses."""
    helm = ensure_helm()
    tmp = tmp_path_factory.mktemp("obs")
    with cluster.api_client() as api:
        core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        core.create_namespace({"metadata": {"name": NS}})
        core.create_namespace({"metadata": {"name": MODELS_NS}})
        core.create_namespaced_secret(NS, {"metadata": {"name": "api-keys"},
                                           "data": {"keys": base64.b64encode(KEYS.encode()).decode()}})
        with diagnostics(cluster, core):
            extra = {"agent": {"cache": {"hostPath": str(tmp / "node-cache")}},
                     "gateway": {"apiKeys": {"existingSecret": "api-keys", "key": "keys"}}}
            held = merged(merged(BASE_VALUES, extra), {"gateway": {"nodeSelector": {"wakegate.io/e2e": "later"}}})
            run_helm(helm, cluster, "install", RELEASE, str(CHART), "--namespace", NS,
                     "-f", values_file(tmp, "install.yaml", held))
            for component in COMPONENTS:
                wait_for(functools.partial(ready_pod, core, component), 120, f"a ready {component} pod", every=1)
            xds_ip = ready_pod(core, "xds").status.pod_ip
            scaler_ip = ready_pod(core, "scaler").status.pod_ip
            addressed = merged(merged(BASE_VALUES, extra), {"gateway": {"xdsHost": xds_ip, "scalerHost": scaler_ip}})
            values = values_file(tmp, "upgrade.yaml", addressed)
            run_helm(helm, cluster, "upgrade", RELEASE, str(CHART), "--namespace", NS, "--wait", "--timeout", "120s",
                     "-f", values)
            gateway_ip = wait_for(lambda: ready_pod(core, "gateway"), 30, "a ready gateway pod").status.pod_ip
            models = {name: {"backend": "sim", **spec} for name, spec in MODELS.items()}
            if LLAMA:
                (tmp / "weights").mkdir()
                models["llama"] = llama_model(write_model(tmp / "weights" / "tiny.gguf", ModelSpec()))
            for name, spec in models.items():
                custom.create_namespaced_custom_object(GROUP, VERSION, MODELS_NS, "models", {
                    "apiVersion": f"{GROUP}/{VERSION}", "kind": "Model", "metadata": {"name": name}, "spec": spec})

            def phases() -> dict[str, str]:
                items = custom.list_namespaced_custom_object(GROUP, VERSION, MODELS_NS, "models")["items"]
                return {m["metadata"]["name"]: (m.get("status") or {}).get("phase", "") for m in items}

            wanted = {"warm": "Ready", "cold": "Idle", "g1": "Idle", "g2": "Idle"}
            wanted |= {"llama": "Ready"} if LLAMA else {}
            wait_for(lambda: phases() == wanted, 120, f"phases {wanted}", every=1)
            docs = [d for d in yaml.safe_load_all(run_helm(
                helm, cluster, "template", RELEASE, str(CHART), "--namespace", NS, "-f", values, *MONITORING)) if d]
            yield {"api": api, "core": core, "custom": custom, "tmp": tmp, "docs": docs, "cluster": cluster,
                   "gateway": f"http://{gateway_ip}:8090", "scaler": scaler_ip, "models": sorted(models)}


@pytest.fixture(scope="module")
def prometheus(install: dict[str, Any]) -> Iterator[tuple[Prometheus, Monitors]]:
    monitors = Monitors(install["docs"], install["core"])
    kinds = {job.split("/")[1] for job in monitors.jobs}
    assert {"wg-wakegate-gateway", "wg-wakegate-scaler", "wg-wakegate-xds", "wg-wakegate-operator",
            "wg-wakegate-backends"} <= kinds, kinds
    prom = Prometheus(install["tmp"], monitors.scrape_configs(install["tmp"]))
    monitors.prom = prom
    stop = threading.Event()

    def keep_resolving() -> None:
        while not stop.wait(1):
            try:
                monitors.refresh()
            except Exception as exc:  # the apiserver may blink under load: next round
                print(f"resolving monitor targets: {exc!r}")

    resolver = threading.Thread(target=keep_resolving, daemon=True)
    try:
        prom.wait_ready()
        monitors.refresh()
        resolver.start()
        yield prom, monitors
    finally:
        stop.set()
        prom.stop()


def gauge(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no {series} in:\n{text[-2000:]}")


def scaler_metrics(install: dict[str, Any]) -> str:
    answer = request("GET", f"http://{install['scaler']}:8080/metrics", timeout=5)
    assert answer.status == 200
    return answer.text


def test_demand_without_the_token_is_refused_counted_and_wakes_nothing(
    install: dict[str, Any], prometheus: tuple[Prometheus, Monitors]
) -> None:
    prom, _ = prometheus
    refused = 'wakegate_internal_auth_refused_total{service="demand"}'
    # Prometheus holds the scaler's count before the refusals (an increase needs two samples).
    at_scaler = refused.replace("}", f', instance="{install["scaler"]}:8080"}}')
    wait_for(lambda: prom.api("query", query=at_scaler)["data"]["result"], 30, "the scaler's refusals scraped")
    before = gauge(scaler_metrics(install), refused)
    forged = demand_pb2.DemandReport(gateway_id="intruder", instance="i", sequence=1, models=[
        demand_pb2.ModelDemand(model=f"{MODELS_NS}/cold", queued=5, leases=1)])
    with grpc.insecure_channel(f"{install['scaler']}:9090") as channel:
        stub = demand_pb2_grpc.DemandServiceStub(channel)
        for metadata in ((), (("authorization", "Bearer not-the-token"),)):
            with pytest.raises(grpc.RpcError) as err:
                stub.Report(forged, metadata=metadata, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert gauge(scaler_metrics(install), refused) - before == 2
    # Prometheus sees it too: the alert for refused internal calls fires (for: 0m).
    wait_for(lambda: any(a["labels"]["alertname"] == "WakegateInternalAuthRefused" and a["state"] == "firing"
                         for a in prom.api("alerts")["data"]["alerts"]), 30, "WakegateInternalAuthRefused firing")
    # Two report intervals later the model is still at zero: the refused demand woke nothing.
    time.sleep(4)
    apps = client.AppsV1Api(install["api"])
    assert apps.read_namespaced_deployment("wg-cold", MODELS_NS).spec.replicas == 0
    assert not install["core"].list_namespaced_pod(MODELS_NS, label_selector="wakegate.io/model=cold").items
    assert "wakegate_demand_members 1.0" in scaler_metrics(install), "only the gateway reports"


def test_a_key_scoped_to_one_model_reaches_no_other(install: dict[str, Any]) -> None:
    url = f"{install['gateway']}/v1"
    warm_only = {"Authorization": f"Bearer {WARM_KEY}"}
    listed = request("GET", f"{url}/models", headers=warm_only)
    assert listed.status == 200, listed.text
    assert [m["id"] for m in listed.json()["data"]] == ["warm"]
    everything = request("GET", f"{url}/models", headers={"Authorization": f"Bearer {ALL_KEY}"})
    assert sorted(m["id"] for m in everything.json()["data"]) == install["models"]
    body = {"model": "cold", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    refused = request("POST", f"{url}/chat/completions", headers=warm_only, body=body)
    assert refused.status == 404, refused.text
    assert refused.json()["error"]["code"] == "model_not_found"
    # ...and the refusal did not wake the model it names.
    assert client.AppsV1Api(install["api"]).read_namespaced_deployment("wg-cold", MODELS_NS).spec.replicas == 0
    assert request("POST", f"{url}/chat/completions", headers=warm_only, body={**body, "model": "warm"}).status == 200
    # No key at all: 401, as before scoping.
    assert request("POST", f"{url}/chat/completions", body=body).status == 401
    # The chart's default keeps /metrics off the clients' port, even for a valid key.
    public = request("GET", f"{install['gateway']}/metrics", headers={"Authorization": f"Bearer {ALL_KEY}"})
    assert public.status == 404 and "wakegate_gateway" not in public.text, (public.status, public.text[:200])


def test_every_panel_returns_data_and_every_alert_evaluates_on_a_cluster(
    install: dict[str, Any], prometheus: tuple[Prometheus, Monitors]
) -> None:
    prom, monitors = prometheus
    with diagnostics(install["cluster"], install["core"]):
        workload(f"{install['gateway']}/v1", headers={"Authorization": f"Bearer {ALL_KEY}"},
                 after_swap=monitors.refresh, cold_timeout=90)
        # Every job the chart's monitors define has a target that Prometheus scrapes.
        def scraped() -> set[str]:
            active = prom.api("targets")["data"]["activeTargets"]
            return {t["labels"]["job"] for t in active if t["health"] == "up"}

        wait_for(lambda: scraped() >= set(monitors.jobs), 30, f"every monitor job up: {sorted(monitors.jobs)}")
        # The backends' job scraped the runtime's path and labelled the series with the model key.
        answer = prom.api("query", query='count by (model) (vllm:num_requests_running)')
        assert {r["metric"]["model"] for r in answer["data"]["result"]} >= {f"{MODELS_NS}/warm", f"{MODELS_NS}/cold"}
        assert_every_panel_returns_data_and_every_alert_evaluates(prom, within=60)

        def value(query: str) -> dict[str, float]:
            result = prom.api("query", query=query)["data"]["result"]
            return {",".join(r["metric"].values()): float(r["value"][1]) for r in result}

        # The cluster's witnesses saw the workload, not just zeros: the operator the cold starts (with
        # their stages), the scaler the GPU-group swap.
        assert value(f'max(wakegate_cold_starts_total{{model="{MODELS_NS}/cold"}})')[""] >= 1
        assert value("sum(wakegate_gpu_swaps_total)")[""] >= 1
        stages = value(f'max by (stage) (wakegate_cold_start_seconds_sum{{model="{MODELS_NS}/cold"}})')
        assert {"scheduled", "process_start", "health_pass", "total"} <= set(stages), stages
        print("cold start of models/cold on the cluster (s):", stages)


def test_llama_cpp_signals_reach_the_model_dashboard(
    install: dict[str, Any], prometheus: tuple[Prometheus, Monitors]
) -> None:
    """The backend PodMonitor scrapes the llama.cpp pod at its runtime's metrics path, and the Model
    dashboard's engine panels (in flight, token throughput) show llama.cpp's own series for it."""
    if not LLAMA:
        missing("llama-server is not built in e2e/.bin (python -m e2e.engines llama-server)")
    prom, _ = prometheus
    url = f"{install['gateway']}/v1/chat/completions"
    body = {"model": "llama", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    for _ in range(2):
        answer = request("POST", url, headers={"Authorization": f"Bearer {ALL_KEY}"}, body=body, timeout=60)
        assert answer.status == 200, answer.text
    key = f"{MODELS_NS}/llama"
    pods = install["core"].list_namespaced_pod(MODELS_NS, label_selector="wakegate.io/model=llama").items
    assert pods[0].metadata.annotations["wakegate.io/metrics-path"] == "/metrics"
    wait_for(lambda: prom.api("query", query=f'llamacpp:tokens_predicted_total{{model="{key}"}} > 0')["data"]["result"],
             30, "llama.cpp's generated tokens scraped under the model key")
    panels = {p.title: p for p in MODEL.panels}

    def answers(expr: str) -> list[Any]:
        result: list[Any] = prom.api("query", query=expr)["data"]["result"]
        return result

    for title in ("In flight", "Token throughput"):
        for target in panels[title].targets:
            expr = expand(target.expr, model=key)
            wait_for(functools.partial(answers, expr), 30, f"{title} [{target.legend}] for {key}: {expr}")
