"""charts/wakegate installed with the real Helm into the real control plane.

Every component runs as pods of the chart (the node agent runs their processes), each with
a bound token of its chart ServiceAccount, so the chart's RBAC is what they get. A Model
applied afterwards serves a chat request through the installed gateway (Envoy + extproc).

Harness limits and how the test bridges them (charts/wakegate/README.md, "A cluster without DNS"):
there is no cluster DNS, so the gateway cannot reach the feeder and the scaler by Service name.
`helm install` brings every component up with the gateway held Pending (a nodeSelector no node
matches); `helm upgrade` then sets `gateway.xdsHost`/`gateway.scalerHost` to those pods' IPs and
lifts the selector. `operator.scalerHost` keeps its Service-name default: only KEDA dials it.

Own cluster (module scope): the chart's operator and feeder watch Models cluster-wide, and its
node agent patches Nodes, which would disturb the other tests' clusters.
"""

from __future__ import annotations

import base64
import functools
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from e2e.cluster import Cluster
from e2e.helm import ensure_helm
from e2e.helpers import is_ready
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "wakegate"
RELEASE, NS, MODELS_NS = "wg", "wakegate-system", "models"
PREFIX = "wg-wakegate"
STALE_LABEL = "wakegate.io/gpu.vendor"
GROUP, VERSION = "wakegate.io", "v1alpha1"

#: e2e settings: one replica each (2 shared cores), a gateway port clear of the scaler's admin
#: port (8080) and the simulators' (8000), since pods on one node share its network namespace.
BASE_VALUES: dict[str, Any] = {
    "operator": {"replicas": 1, "leaseSeconds": 10},
    "agent": {"interval": 2},
    "gateway": {"replicas": 1, "port": 8090, "drainSeconds": 1},
}
COMPONENTS = ("operator", "xds", "scaler", "scheduler-extender")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    own = Cluster(tmp_path_factory.mktemp("helm-cluster"), nodes=2)
    own.start()
    try:
        yield own
    finally:
        own.stop()


@pytest.fixture(scope="module")
def helm() -> Path:
    return ensure_helm()


def run_helm(helm: Path, cluster: Cluster, *args: str, timeout: float = 180) -> str:
    out = subprocess.run(
        [str(helm), "--kubeconfig", str(cluster.kubeconfig), *args],
        capture_output=True, text=True, timeout=timeout,
    )
    assert out.returncode == 0, f"helm {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def values_file(tmp: Path, name: str, values: dict[str, Any]) -> str:
    path = tmp / name
    path.write_text(yaml.safe_dump(values))
    return str(path)


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(json.dumps(base))
    for key, value in extra.items():
        out[key] = {**out.get(key, {}), **value}
    return out


def pods(core: client.CoreV1Api, component: str) -> list[Any]:
    selector = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component={component}"
    return [p for p in core.list_namespaced_pod(NS, label_selector=selector).items if not p.metadata.deletion_timestamp]


def ready_pod(core: client.CoreV1Api, component: str) -> Any:
    return next((p for p in pods(core, component) if is_ready(p)), None)


def logs(cluster: Cluster, ns: str = NS) -> dict[str, str]:
    """Every container's output in `ns`: `<pod>/<container>` -> text."""
    base = cluster.dir / "agent" / "pods" / ns
    return {f"{path.parent.name}/{path.stem}": path.read_text(errors="replace")
            for path in sorted(base.glob("*/*.log"))}


@contextmanager
def diagnostics(cluster: Cluster, core: client.CoreV1Api) -> Iterator[None]:
    """On failure, print the pods and the tail of every container log (pytest shows it)."""
    try:
        yield
    except BaseException:
        for ns in (NS, MODELS_NS):
            try:
                for pod in core.list_namespaced_pod(ns).items:
                    states = [(c.name, c.ready, c.state.waiting.reason if c.state.waiting else "")
                              for c in pod.status.container_statuses or []]
                    print(f"pod {ns}/{pod.metadata.name} on {pod.spec.node_name}: {pod.status.phase} "
                          f"{pod.status.pod_ip} {states}")
            except ApiException as exc:
                print(f"listing pods in {ns}: {exc.reason}")
            for name, text in logs(cluster, ns).items():
                print(f"----- {ns}/{name} (last 40 lines)\n" + "\n".join(text.splitlines()[-40:]))
        raise


def token_client(cluster: Cluster, core: client.CoreV1Api, account: str) -> client.ApiClient:
    """An API client holding a bound token (TokenRequest) of the chart's ServiceAccount `account`."""
    token = core.create_namespaced_service_account_token(
        account, NS, {"spec": {"expirationSeconds": 600}}
    ).status.token
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    server = dict(admin["clusters"][0]["cluster"])
    if "certificate-authority" in server:
        ca = base64.b64encode(Path(server.pop("certificate-authority")).read_bytes()).decode()
        server["certificate-authority-data"] = ca
    return config.new_client_from_config_dict({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "e2e", "cluster": server}],
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [{"name": account, "context": {"cluster": "e2e", "user": account}}],
        "current-context": account,
    })


def refused(call: Callable[[client.ApiClient], Any], api: client.ApiClient) -> int:
    """The HTTP status of a call that must be refused (403: authenticated, not authorized)."""
    try:
        call(api)
    except ApiException as exc:
        return int(exc.status)
    return 200


def chat(url: str, model: str) -> tuple[int, dict[str, Any]]:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hello"}],
                       "max_tokens": 4}).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        raw = err.read()
        err.close()
        return err.code, {"raw": raw.decode(errors="replace")}
    except (urllib.error.URLError, OSError) as exc:
        return 0, {"error": str(exc)}


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        err.close()
        return err.code, ""
    except (urllib.error.URLError, OSError):
        return 0, ""


def test_helm_install_runs_every_component_with_its_own_rbac_and_serves_a_model(
    cluster: Cluster, helm: Path, tmp_path: Path
) -> None:
    started = time.monotonic()
    timings: dict[str, float] = {}
    with cluster.api_client() as api:
        core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
        custom, coordination = client.CustomObjectsApi(api), client.CoordinationV1Api(api)
        nodes = [n.metadata.name for n in core.list_node().items]
        # A stale wakegate GPU label: the agent (no GPU on this machine) must patch it away.
        for node in nodes:
            core.patch_node(node, {"metadata": {"labels": {STALE_LABEL: "stale"}}})
        core.create_namespace({"metadata": {"name": MODELS_NS}})
        with diagnostics(cluster, core):
            # 1. Install: every component but the gateway starts (the gateway waits, Pending, for
            #    the feeder's and the scaler's addresses, which a cluster with DNS would resolve).
            # The node cache in this test's folder (pods share this machine's file system).
            cache = {"agent": {"cache": {"hostPath": str(tmp_path / "node-cache")}}}
            held = merged(BASE_VALUES, {"gateway": {"nodeSelector": {"wakegate.io/e2e": "after-upgrade"}}, **cache})
            run_helm(helm, cluster, "install", RELEASE, str(CHART), "--namespace", NS, "--create-namespace",
                     "-f", values_file(tmp_path, "install.yaml", held))
            for component in COMPONENTS:
                wait_for(functools.partial(ready_pod, core, component), 120, f"a ready {component} pod", every=1)
            wait_for(lambda: apps.read_namespaced_daemon_set(f"{PREFIX}-agent", NS).status.number_ready == len(nodes),
                     60, "the agent DaemonSet on every GPU node", every=1)
            timings["install"] = time.monotonic() - started
            gateway = pods(core, "gateway")
            assert gateway and all(p.status.phase == "Pending" for p in gateway)

            # 2. Upgrade with the addresses a cluster without DNS needs; --wait: the gateway is Ready.
            xds_ip = ready_pod(core, "xds").status.pod_ip
            scaler_ip = ready_pod(core, "scaler").status.pod_ip
            addressed = merged(BASE_VALUES, {"gateway": {"xdsHost": xds_ip, "scalerHost": scaler_ip}, **cache})
            run_helm(helm, cluster, "upgrade", RELEASE, str(CHART), "--namespace", NS, "--wait", "--timeout", "120s",
                     "-f", values_file(tmp_path, "upgrade.yaml", addressed))
            gateway_pod = wait_for(lambda: ready_pod(core, "gateway"), 30, "a ready gateway pod")
            assert gateway_pod.spec.automount_service_account_token is False
            timings["upgrade"] = time.monotonic() - started

            # 3. A Model applied afterwards is rendered by the operator, scaled by the scaler's
            #    builtin engine, routed by the feeder and served through the gateway's Envoy + extproc.
            custom.create_namespaced_custom_object(GROUP, VERSION, MODELS_NS, "models", {
                "apiVersion": f"{GROUP}/{VERSION}", "kind": "Model", "metadata": {"name": "chat"},
                "spec": {"backend": "sim", "scaling": {"min": 1, "max": 1, "engine": "builtin"}},
            })
            wait_for(lambda: ((custom.get_namespaced_custom_object(GROUP, VERSION, MODELS_NS, "models", "chat")
                               .get("status") or {}).get("phase") == "Ready"), 120, "Model chat Ready", every=1)
            url = f"http://{gateway_pod.status.pod_ip}:8090"
            answer: dict[str, Any] = {}

            def served() -> bool:
                status, body = chat(url, "chat")
                answer.update(status=status, body=body)
                return status == 200

            wait_for(served, 60, f"a 200 from the installed gateway at {url} (last: {answer})", every=1)
            assert answer["body"]["choices"][0]["message"]["content"]
            timings["served"] = time.monotonic() - started

            # 4. Each component did its job with its chart ServiceAccount.
            assert wait_for(lambda: all(STALE_LABEL not in (core.read_node(n).metadata.labels or {}) for n in nodes),
                            30, "the agents removing the stale GPU label (get + patch Nodes)", every=1)
            lease = coordination.read_namespaced_lease(f"{PREFIX}-scaler", NS)
            assert lease.spec.holder_identity, "the scaler's builtin engine holds its Lease"
            assert coordination.read_namespaced_lease(f"{PREFIX}-operator", NS).spec.holder_identity
            wait_for(lambda: "scaled models/chat to 1 replicas" in next(
                t for n, t in logs(cluster).items() if n.startswith(f"{PREFIX}-scaler-")),
                30, "the scaler patching deployments/scale of models/chat")
            status, metrics = http_get(f"http://{scaler_ip}:8080/metrics")
            assert status == 200 and "wakegate_scaler_leader 1.0" in metrics, metrics[-2000:]
            # The gateway's extproc reports demand to the scaler (gateway.scalerHost).
            wait_for(lambda: "wakegate_demand_members 1.0" in http_get(f"http://{scaler_ip}:8080/metrics")[1],
                     30, "the installed gateway as a live demand-report member of the scaler", every=1)
            extender_ip = ready_pod(core, "scheduler-extender").status.pod_ip
            assert http_get(f"http://{extender_ip}:8888/readyz")[0] == 200, "the extender's Node watch is synced"

            # 5. RBAC is enough: no component was refused anything.
            texts = logs(cluster)
            assert {name.rsplit("/", 1)[1] for name in texts} >= {
                "operator", "xds", "scaler", "extender", "agent", "envoy", "extproc"}
            for name, text in texts.items():
                assert "Forbidden" not in text and "forbidden" not in text and " 403" not in text, (
                    f"{name} was refused by the apiserver:\n{text[-3000:]}")

            # 6. ...and no more: each ServiceAccount's token is refused writes it must not make.
            deployment = {"metadata": {"name": "intruder"}, "spec": {
                "selector": {"matchLabels": {"app": "x"}},
                "template": {"metadata": {"labels": {"app": "x"}},
                             "spec": {"containers": [{"name": "x", "image": "x"}]}}}}
            label_node = {"metadata": {"labels": {"intruder": "yes"}}}
            model_patch = {"spec": {"scaling": {"max": 9}}}
            checks: dict[str, list[tuple[str, Callable[[client.ApiClient], Any]]]] = {
                "gateway": [
                    ("list Models", lambda c: client.CustomObjectsApi(c).list_cluster_custom_object(
                        GROUP, VERSION, "models")),
                    ("create a Deployment", lambda c: client.AppsV1Api(c).create_namespaced_deployment(
                        MODELS_NS, deployment, dry_run="All")),
                ],
                "operator": [
                    ("patch a Node", lambda c: client.CoreV1Api(c).patch_node(nodes[0], label_node, dry_run="All")),
                    ("read Secrets", lambda c: client.CoreV1Api(c).list_namespaced_secret(NS)),
                ],
                "xds": [
                    ("create a Deployment", lambda c: client.AppsV1Api(c).create_namespaced_deployment(
                        MODELS_NS, deployment, dry_run="All")),
                    ("patch a Model", lambda c: client.CustomObjectsApi(c).patch_namespaced_custom_object(
                        GROUP, VERSION, MODELS_NS, "models", "chat", model_patch, dry_run="All")),
                ],
                "scaler": [
                    ("create a Deployment", lambda c: client.AppsV1Api(c).create_namespaced_deployment(
                        MODELS_NS, deployment, dry_run="All")),
                    ("patch a Deployment (not its scale)", lambda c: client.AppsV1Api(c).patch_namespaced_deployment(
                        "wg-chat", MODELS_NS, {"metadata": {"labels": {"intruder": "yes"}}}, dry_run="All")),
                    ("patch a Model", lambda c: client.CustomObjectsApi(c).patch_namespaced_custom_object(
                        GROUP, VERSION, MODELS_NS, "models", "chat", model_patch, dry_run="All")),
                ],
                "agent": [
                    ("create a Deployment", lambda c: client.AppsV1Api(c).create_namespaced_deployment(
                        MODELS_NS, deployment, dry_run="All")),
                    ("delete a Node", lambda c: client.CoreV1Api(c).delete_node(nodes[0], dry_run="All")),
                ],
                "scheduler-extender": [
                    ("patch a Node", lambda c: client.CoreV1Api(c).patch_node(nodes[0], label_node, dry_run="All")),
                    ("create a ConfigMap", lambda c: client.CoreV1Api(c).create_namespaced_config_map(
                        NS, {"metadata": {"name": "intruder"}}, dry_run="All")),
                ],
            }
            #: one allowed call per component: the token itself is good (so 403 above is RBAC).
            allowed: dict[str, Callable[[client.ApiClient], Any]] = {
                "operator": lambda c: client.AppsV1Api(c).create_namespaced_deployment(
                    MODELS_NS, deployment, dry_run="All"),
                "xds": lambda c: client.CustomObjectsApi(c).list_cluster_custom_object(GROUP, VERSION, "models"),
                "scaler": lambda c: client.AppsV1Api(c).read_namespaced_deployment_scale("wg-chat", MODELS_NS),
                "agent": lambda c: client.CoreV1Api(c).patch_node(nodes[0], label_node, dry_run="All"),
                "scheduler-extender": lambda c: client.CoreV1Api(c).list_node(),
            }
            for component, calls in checks.items():
                with token_client(cluster, core, f"{PREFIX}-{component}") as scoped:
                    if component in allowed:
                        allowed[component](scoped)
                    for what, call in calls:
                        code = refused(call, scoped)
                        assert code == 403, f"{component}'s token: {what} answered {code}, want 403"
            timings["total"] = time.monotonic() - started
            print("timings (s from start):", {k: round(v, 1) for k, v in timings.items()})
