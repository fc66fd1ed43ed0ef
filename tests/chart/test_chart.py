"""charts/wakegate checked by the real Helm (built from its Go module, see e2e/helm):
lint, template with defaults and with every documented option, the values schema, RBAC shape."""

from __future__ import annotations

import base64
import hashlib
import http.client
import itertools
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.helm import HELM, BuildError, ensure_helm, is_current
from tests.support.required import missing
from tests.support.up import UpProcess, model_doc
from wakegate.control.admin import free_port
from wakegate.control.bootstrap import envoy_binary

CHART = Path(__file__).resolve().parents[2] / "charts" / "wakegate"
MONITORING = (
    "--api-versions",
    "monitoring.coreos.com/v1/ServiceMonitor",
    "--api-versions",
    "monitoring.coreos.com/v1/PrometheusRule",
)

#: Every documented option set away from its default.
EVERY_OPTION: dict[str, Any] = {
    "image": {"repository": "registry.example/wakegate/wakegate", "tag": "1.2.3", "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "commonLabels": {"team": "ml"},
    "internalToken": {"existingSecret": "internal-token", "key": "tok"},
    "networkPolicy": {"enabled": False},
    "operator": {
        "replicas": 3,
        "workers": 8,
        "scalerHost": "10.0.0.9",
        "installRuntimes": False,
        "leaseSeconds": 20,
        "logLevel": "debug",
        "pdb": {"minAvailable": 2},
        "resources": {"requests": {"cpu": "100m"}},
        "nodeSelector": {"pool": "system"},
        "tolerations": [{"key": "x", "operator": "Exists"}],
        "affinity": {"nodeAffinity": {}},
    },
    "xds": {"replicas": 2, "port": 18001, "adminPort": 9211, "logLevel": "DEBUG", "nodeSelector": {"pool": "system"}},
    "scaler": {
        "replicas": 2,
        "demandPort": 9190,
        "kedaPort": 9191,
        "adminPort": 8181,
        "tlsSecret": "scaler-tls",
        "tls": {"generate": False, "kedaClientSecret": "keda-mtls", "modelNamespaces": ["models"]},
    },
    "gateway": {
        "replicas": 3,
        "port": 8000,
        "xdsHost": "10.0.0.7",
        "scalerHost": "10.0.0.8",
        "service": {"type": "LoadBalancer", "port": 443, "annotations": {"a": "b"}},
        "apiKeys": {"existingSecret": "api-keys", "key": "k"},
        "publicMetrics": "keys",
        "maxBodyBytes": 1048576,
        "globalRps": 100,
        "globalBurst": 200,
        "keepaliveSeconds": 1,
        "drainSeconds": 10,
        "pdb": {"minAvailable": "50%"},
        "envoy": {
            "image": {"repository": "mirror/envoy", "tag": "v1.40.1", "pullPolicy": "Always"},
            "concurrency": 4,
            "metricsPort": 9912,
            "resources": {"limits": {"cpu": "2"}},
        },
        "extproc": {"resources": {"limits": {"cpu": "1"}}},
    },
    "agent": {
        "interval": 30,
        "gpuNodeLabels": ["custom/gpu"],
        "logLevel": "DEBUG",
        "tolerations": [],
        "cache": {
            "enabled": True,
            "hostPath": "/mnt/nvme/wakegate",
            "maxSize": "500G",
            "retrySeconds": 30,
            "readCredentials": False,
        },
    },
    "schedulerExtender": {"replicas": 2, "port": 8899, "benchConfigMap": "bench", "exampleSchedulerConfig": False},
    "metrics": {
        "serviceMonitor": {"interval": "15s", "labels": {"release": "prom"}},
        "prometheusRule": {"labels": {"release": "prom"}},
    },
    "dashboards": {
        "label": "grafana_dashboard_x",
        "labelValue": "yes",
        "namespace": "monitoring",
        "annotations": {"grafana_folder": "wakegate"},
    },
}
DISABLED = {key: {"enabled": False} for key in ("operator", "xds", "scaler", "agent", "schedulerExtender")}


@pytest.fixture(scope="session")
def helm() -> Path:
    if not is_current() and shutil.which("go") is None:
        missing("helm is not built and `go` is missing (python -m e2e.helm builds it)")
    try:
        return ensure_helm()
    except BuildError as exc:
        pytest.fail(f"building helm failed: {exc}")


def run(helm: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([str(helm), *args], capture_output=True, text=True)
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


def template(helm: Path, tmp: Path, values: dict[str, Any] | None = None, *extra: str) -> list[dict[str, Any]]:
    args = ["template", "wg", str(CHART), "--namespace", "wakegate-system", *extra]
    if values is not None:
        (tmp / "values.yaml").write_text(yaml.safe_dump(values))
        args += ["-f", str(tmp / "values.yaml")]
    return [doc for doc in yaml.safe_load_all(run(helm, *args).stdout) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def test_lint_default_and_every_option(helm: Path, tmp_path: Path) -> None:
    run(helm, "lint", "--strict", str(CHART))
    (tmp_path / "v.yaml").write_text(yaml.safe_dump(EVERY_OPTION))
    run(helm, "lint", "--strict", str(CHART), "-f", str(tmp_path / "v.yaml"))


def test_default_render(helm: Path, tmp_path: Path) -> None:
    docs = template(helm, tmp_path)
    deployments = by_kind(docs, "Deployment")
    assert set(deployments) == {
        f"wg-wakegate-{c}" for c in ("operator", "xds", "scaler", "gateway", "scheduler-extender")
    }
    operator = deployments["wg-wakegate-operator"]["spec"]
    assert operator["replicas"] == 2
    scaler = deployments["wg-wakegate-scaler"]["spec"]
    assert (scaler["replicas"], scaler["strategy"]) == (1, {"type": "Recreate"}), "one scaler, never two in a rollout"
    assert "podAntiAffinity" in operator["template"]["spec"]["affinity"]
    pdbs = by_kind(docs, "PodDisruptionBudget")
    assert pdbs["wg-wakegate-operator"]["spec"]["minAvailable"] == 1
    assert "wg-wakegate-gateway" in pdbs, "two gateway replicas get a PDB"
    gateway = deployments["wg-wakegate-gateway"]["spec"]["template"]["spec"]
    assert [c["name"] for c in gateway["containers"]] == ["envoy", "extproc"]
    extproc = gateway["containers"][1]
    assert "--public-metrics=off" in extproc["args"], "/metrics is not on the public port by default"
    assert not any(a.startswith("--api-keys-file") for a in extproc["args"])
    assert gateway["automountServiceAccountToken"] is False
    agent = by_kind(docs, "DaemonSet")["wg-wakegate-agent"]["spec"]["template"]["spec"]
    terms = agent["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {t["matchExpressions"][0]["key"] for t in terms} == {"nvidia.com/gpu.present", "amd.com/gpu.present"}
    images = {
        c["image"]
        for d in [*deployments.values(), by_kind(docs, "DaemonSet")["wg-wakegate-agent"]]
        for c in d["spec"]["template"]["spec"]["containers"]
        if c["name"] != "envoy"
    }
    assert images == {"ghcr.io/wakegate/wakegate:0.1.0"}, "one image for every wakegate component"
    assert set(by_kind(docs, "Secret")) == {
        "wg-wakegate-internal-token",
        "wg-wakegate-scaler-tls",
        "wakegate-keda-client",
    }, "only the generated ones"
    assert "wg-wakegate-scheduler-extender-example" in by_kind(docs, "ConfigMap")
    dashboards = [n for n in by_kind(docs, "ConfigMap") if "-dashboard-" in n]
    assert len(dashboards) == 3
    assert not by_kind(docs, "ServiceMonitor") and not by_kind(docs, "PrometheusRule"), "no Prometheus Operator CRDs"


def test_gateway_bootstrap_is_valid_for_envoy(helm: Path, tmp_path: Path) -> None:
    """The chart's Envoy bootstrap (rendered from envoy/bootstrap.yaml) as the real Envoy reads it."""
    for values in (None, {"gateway": {"xdsHost": "10.0.0.7", "envoy": {"metricsPort": 9912}}, "xds": {"port": 18001}}):
        docs = template(helm, tmp_path, values)
        text = by_kind(docs, "ConfigMap")["wg-wakegate-gateway-envoy"]["data"]["envoy.yaml"]
        config = yaml.safe_load(text)
        clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
        xds = clusters["wakegate_xds"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        assert clusters["wakegate_xds"]["type"] == "STRICT_DNS"  # a Service name, or whatever xdsHost says
        if values is None:
            assert xds["address"]["socket_address"]["address"] == "wg-wakegate-xds.wakegate-system.svc"
        else:
            assert xds["address"]["socket_address"] == {"address": "10.0.0.7", "port_value": 18001}
            assert config["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] == 9912
        (tmp_path / "envoy.yaml").write_text(text)
        out = subprocess.run(
            [envoy_binary(), "--mode", "validate", "-c", str(tmp_path / "envoy.yaml")],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "WAKEGATE_INTERNAL_TOKEN": "t"},
        )
        assert out.returncode == 0, out.stdout + out.stderr


def test_rbac_least_privilege(helm: Path, tmp_path: Path) -> None:
    docs = template(helm, tmp_path)
    bound = {
        b["subjects"][0]["name"]
        for b in [*by_kind(docs, "ClusterRoleBinding").values(), *by_kind(docs, "RoleBinding").values()]
    }
    assert "wg-wakegate-gateway" not in bound, "the gateway gets no Kubernetes access at all"
    roles = {**by_kind(docs, "ClusterRole"), **{f"ns/{k}": v for k, v in by_kind(docs, "Role").items()}}
    writes = {"create", "update", "patch", "delete"}

    def rules(name: str) -> set[tuple[str, str, str]]:
        return {
            (g, r, v)
            for rule in roles[name]["rules"]
            for g in rule["apiGroups"]
            for r in rule["resources"]
            for v in rule["verbs"]
        }

    # The agent gets exactly the rules its e2e test (prewarm into the node cache) runs with, and
    # `list` on Pods for the KV-cache annotation (it asks only for those on its node).
    from e2e.gateway import AGENT_RULES

    assert rules("wg-wakegate-agent") == {
        (g, r, v) for rule in AGENT_RULES for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]
    } | {("", "pods", "list")}
    assert {(g, r, v) for g, r, v in rules("wg-wakegate-agent") if v in writes} == {
        ("", "nodes", "patch"),
        ("wakegate.io", "modelcaches/status", "patch"),
    }
    assert rules("wg-wakegate-xds") == {
        (g, r, v)
        for g, r in (
            ("wakegate.io", "models"),
            ("wakegate.io", "loraadapters"),
            ("discovery.k8s.io", "endpointslices"),
            ("", "nodes"),
        )
        for v in ("get", "list", "watch")
    } | {("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")}  # Kopf discovery
    writers = {name for name in roles if any(v in writes for _, r, v in rules(name) if r != "leases")}
    assert writers == {"wg-wakegate-operator", "wg-wakegate-scaler", "wg-wakegate-agent"}
    # The scaler writes replicas (builtin engine) and, of a Model, only its status (`waitingFor`).
    assert {(g, r, v) for g, r, v in rules("wg-wakegate-scaler") if v in writes} == {
        ("apps", "deployments/scale", "patch"),
        ("wakegate.io", "models/status", "patch"),
    }
    # Secrets: only the agent and the operator, only `get` (the registry credentials a ModelCache or a
    # ModelCatalog names), never list.
    assert {(name, v) for name in roles for _, r, v in rules(name) if r == "secrets"} == {
        ("wg-wakegate-agent", "get"),
        ("wg-wakegate-operator", "get"),
    }
    # ModelCatalogs: the operator reads them and writes only their status.
    assert {(r, v) for _, r, v in rules("wg-wakegate-operator") if r.startswith("modelcatalogs")} == {
        ("modelcatalogs", "get"),
        ("modelcatalogs", "list"),
        ("modelcatalogs", "watch"),
        ("modelcatalogs/status", "patch"),
    }
    # LoRAAdapters: the operator reads them and writes only their status; the feeder reads them.
    assert {(r, v) for _, r, v in rules("wg-wakegate-operator") if r.startswith("loraadapters")} == {
        ("loraadapters", "get"),
        ("loraadapters", "list"),
        ("loraadapters", "watch"),
        ("loraadapters/status", "patch"),
    }
    # The operator gets exactly the rules its e2e test proves enough (docs/operator.md).
    from e2e.gateway import OPERATOR_RULES

    assert rules("wg-wakegate-operator") == {
        (g, r, v)
        for rule in OPERATOR_RULES
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


def _cert(pem_b64: str) -> Any:
    from cryptography import x509

    return x509.load_pem_x509_certificate(base64.b64decode(pem_b64))


def test_scaler_mtls_is_generated_by_default_for_keda_and_the_scaler(helm: Path, tmp_path: Path) -> None:
    """KEDA's port is mTLS out of the box: a CA, the scaler's server certificate for its Service
    names, KEDA's client certificate in each namespace of keda Models, and the operator told to
    name that Secret in every TriggerAuthentication."""
    from cryptography import x509

    docs = template(helm, tmp_path, {"scaler": {"tls": {"modelNamespaces": ["models", "team-b"]}}})
    secrets = {(d["metadata"]["namespace"], d["metadata"]["name"]): d for d in docs if d["kind"] == "Secret"}
    server = secrets[("wakegate-system", "wg-wakegate-scaler-tls")]["data"]
    clients = [secrets[(ns, "wakegate-keda-client")]["data"] for ns in ("models", "team-b")]
    assert ("wakegate-system", "wakegate-keda-client") not in secrets
    assert clients[0] == clients[1], "one client certificate, the same in every namespace"
    ca = _cert(server["ca.crt"])
    for data in (server, *clients):
        assert _cert(data["ca.crt"]) == ca
        cert = _cert(data["tls.crt"])
        assert cert.issuer == ca.subject and cert != ca
        cert.verify_directly_issued_by(ca)
    sans = _cert(server["tls.crt"]).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "wg-wakegate-scaler.wakegate-system.svc" in sans.get_values_for_type(x509.DNSName)
    deployments = by_kind(docs, "Deployment")
    scaler = deployments["wg-wakegate-scaler"]["spec"]["template"]
    assert "--tls-client-ca=/var/run/wakegate/tls/ca.crt" in scaler["spec"]["containers"][0]["args"]
    assert scaler["spec"]["volumes"] == [{"name": "tls", "secret": {"secretName": "wg-wakegate-scaler-tls"}}]
    assert "checksum/scaler-tls" in scaler["metadata"]["annotations"]
    operator = deployments["wg-wakegate-operator"]["spec"]["template"]["spec"]["containers"][0]
    assert "--keda-auth-secret=wakegate-keda-client" in operator["args"]
    # An IP for operator.scalerHost (a cluster without DNS) goes into the certificate too.
    docs = template(helm, tmp_path, {"operator": {"scalerHost": "10.1.2.3"}})
    server = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "wg-wakegate-scaler-tls")
    sans = _cert(server["data"]["tls.crt"]).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["10.1.2.3"]
    # Off: a plaintext KEDA port and no TriggerAuthentication.
    docs = template(helm, tmp_path, {"scaler": {"tls": {"generate": False}}})
    deployments = by_kind(docs, "Deployment")
    assert not any(
        a.startswith("--tls")
        for a in deployments["wg-wakegate-scaler"]["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    assert not any(
        a.startswith("--keda-auth-secret")
        for a in deployments["wg-wakegate-operator"]["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    assert not [d for d in docs if d["kind"] == "Secret" and "tls" in d["metadata"]["name"]]


def test_every_option_renders(helm: Path, tmp_path: Path) -> None:
    docs = template(helm, tmp_path, EVERY_OPTION, *MONITORING)
    deployments = by_kind(docs, "Deployment")
    gateway = deployments["wg-wakegate-gateway"]["spec"]["template"]["spec"]
    extproc = next(c for c in gateway["containers"] if c["name"] == "extproc")
    assert "--api-keys-file=/var/run/wakegate/api-keys/keys" in extproc["args"]
    assert "--public-metrics=keys" in extproc["args"]
    token_ref = {"secretKeyRef": {"name": "internal-token", "key": "tok"}}
    assert all(_token_env(c) == token_ref for c in _token_parties(deployments)), "the user's Secret, by env"
    assert (
        "--admin-listen=$(POD_IP):9211"
        in deployments["wg-wakegate-xds"]["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    assert {v["name"]: v.get("secret", {}).get("secretName") for v in gateway["volumes"]}["api-keys"] == "api-keys"
    assert by_kind(docs, "PodDisruptionBudget")["wg-wakegate-gateway"]["spec"]["minAvailable"] == "50%"
    scaler = deployments["wg-wakegate-scaler"]["spec"]["template"]["spec"]["containers"][0]
    assert "--tls-client-ca=/var/run/wakegate/tls/ca.crt" in scaler["args"]
    operator = deployments["wg-wakegate-operator"]["spec"]["template"]["spec"]["containers"][0]
    assert "--keda-auth-secret=keda-mtls" in operator["args"]
    assert not [d for d in docs if d["kind"] == "Secret" and d["type"] == "kubernetes.io/tls"], "the user's own"
    assert (
        "--no-install-runtimes"
        in deployments["wg-wakegate-operator"]["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    assert "--xds=10.0.0.7:18001" in extproc["args"] and "--demand=10.0.0.8:9190" in extproc["args"]
    assert set(by_kind(docs, "ServiceMonitor")) == {"wg-wakegate-gateway", "wg-wakegate-scaler", "wg-wakegate-xds"}
    scraped = by_kind(docs, "ServiceMonitor")["wg-wakegate-gateway"]["spec"]["endpoints"]
    # extproc's admin port and Envoy's stats, never the public port (whatever publicMetrics says).
    expected = {("metrics", "/metrics"), ("envoy-metrics", "/stats/prometheus")}
    assert {(e["port"], e["path"]) for e in scraped} == expected
    assert set(by_kind(docs, "PodMonitor")) == {"wg-wakegate-backends", "wg-wakegate-operator"}
    operator_monitor = by_kind(docs, "PodMonitor")["wg-wakegate-operator"]["spec"]
    assert [(e["port"], e["path"]) for e in operator_monitor["podMetricsEndpoints"]] == [("metrics", "/metrics")]
    operator_ports = deployments["wg-wakegate-operator"]["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert operator_ports == [{"name": "metrics", "containerPort": 9210}]
    # Backends: the runtime's metrics path from the pod's annotation; pods without one are not scraped.
    backends = by_kind(docs, "PodMonitor")["wg-wakegate-backends"]["spec"]["podMetricsEndpoints"][0]
    relabel = {r.get("targetLabel", r.get("action")): r for r in backends["relabelings"]}
    assert relabel["keep"]["sourceLabels"] == ["__meta_kubernetes_pod_annotationpresent_wakegate_io_metrics_path"]
    assert relabel["__metrics_path__"]["sourceLabels"] == ["__meta_kubernetes_pod_annotation_wakegate_io_metrics_path"]
    assert backends["port"] == "http"
    rule = by_kind(docs, "PrometheusRule")["wg-wakegate"]
    assert rule["metadata"]["labels"]["release"] == "prom"
    assert len(rule["spec"]["groups"][0]["rules"]) >= 6
    dashboards = [d for n, d in by_kind(docs, "ConfigMap").items() if "-dashboard-" in n]
    assert all(
        d["metadata"]["namespace"] == "monitoring" and d["metadata"]["labels"]["grafana_dashboard_x"] == "yes"
        for d in dashboards
    )
    assert "wg-wakegate-scheduler-extender-example" not in by_kind(docs, "ConfigMap")
    assert not by_kind(docs, "Secret"), "with a named Secret the chart creates none"
    assert not any(
        "checksum/internal-token" in (d["spec"]["template"]["metadata"].get("annotations") or {})
        for d in deployments.values()
    )
    assert not by_kind(docs, "NetworkPolicy")
    agent = by_kind(docs, "DaemonSet")["wg-wakegate-agent"]["spec"]["template"]["spec"]
    args = agent["containers"][0]["args"]
    assert {"--cache-dir=/mnt/nvme/wakegate", "--cache-max-size=500G", "--retry-seconds=30"} <= set(args)
    host = {"path": "/mnt/nvme/wakegate", "type": "DirectoryOrCreate"}
    assert agent["volumes"][0] == {"name": "cache", "hostPath": host}
    operator_args = deployments["wg-wakegate-operator"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--node-cache-dir=/mnt/nvme/wakegate" in operator_args
    agent_role = by_kind(docs, "ClusterRole")["wg-wakegate-agent"]
    assert not any("secrets" in rule["resources"] for rule in agent_role["rules"]), "readCredentials: false"


def test_agent_node_cache_by_default(helm: Path, tmp_path: Path) -> None:
    """The node cache as a hostPath the agent owns (an init container hands it over) and writes as
    its own non-root user; credentials only in a memory-backed TMPDIR."""
    agent = by_kind(template(helm, tmp_path), "DaemonSet")["wg-wakegate-agent"]["spec"]["template"]["spec"]
    container = agent["containers"][0]
    assert "--cache-dir=/var/lib/wakegate/cache" in container["args"]
    assert {"name": "cache", "mountPath": "/var/lib/wakegate/cache"} in container["volumeMounts"]
    assert container["securityContext"]["runAsNonRoot"] is True
    assert {"name": "TMPDIR", "value": "/run/wakegate/tmp"} in container["env"]
    assert {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}} in agent["volumes"]
    (init,) = agent["initContainers"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert init["args"][-2:] == ["--cache-dir=/var/lib/wakegate/cache", "--prepare-cache=10001"]
    off = template(helm, tmp_path, {"agent": {"cache": {"enabled": False}}})
    plain = by_kind(off, "DaemonSet")["wg-wakegate-agent"]["spec"]["template"]["spec"]
    assert "volumes" not in plain and "initContainers" not in plain
    assert not any(a.startswith("--cache-dir") for a in plain["containers"][0]["args"])
    assert [r["resources"] for r in by_kind(off, "ClusterRole")["wg-wakegate-agent"]["rules"]] == [["nodes"], ["pods"]]
    assert "--kv-cache-usage" in plain["containers"][0]["args"]
    bare = template(helm, tmp_path, {"agent": {"cache": {"enabled": False}, "kvCacheUsage": False}})
    bare_agent = by_kind(bare, "DaemonSet")["wg-wakegate-agent"]["spec"]["template"]["spec"]["containers"][0]
    assert "--kv-cache-usage" not in bare_agent["args"]
    assert [r["resources"] for r in by_kind(bare, "ClusterRole")["wg-wakegate-agent"]["rules"]] == [["nodes"]]


def _token_parties(deployments: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The containers that present or check the internal token: feeder, scaler, Envoy and extproc."""
    pods = [deployments[f"wg-wakegate-{c}"]["spec"]["template"]["spec"] for c in ("xds", "scaler", "gateway")]
    return [c for pod in pods for c in pod["containers"]]


def _token_env(container: dict[str, Any]) -> dict[str, Any] | None:
    for var in container.get("env", []):
        if var["name"] == "WAKEGATE_INTERNAL_TOKEN":
            return var["valueFrom"]  # type: ignore[no-any-return]
    return None


def test_internal_token_secret_and_network_policies_by_default(helm: Path, tmp_path: Path) -> None:
    docs = template(helm, tmp_path)
    secret = by_kind(docs, "Secret")["wg-wakegate-internal-token"]
    assert secret["metadata"]["name"] == "wg-wakegate-internal-token"
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) == 48 and token.isalnum()
    again = by_kind(template(helm, tmp_path), "Secret")["wg-wakegate-internal-token"]["data"]["token"]
    assert again != secret["data"]["token"], "random per install (an upgrade reads the old one back)"
    deployments = by_kind(docs, "Deployment")
    # The pods holding the token carry its digest: a changed generated token rolls them together.
    digest = hashlib.sha256(secret["data"]["token"].encode()).hexdigest()[:16]
    for component in ("xds", "scaler", "gateway"):
        annotations = deployments[f"wg-wakegate-{component}"]["spec"]["template"]["metadata"]["annotations"]
        assert annotations["checksum/internal-token"] == digest
    parties = _token_parties(deployments)
    assert [c["name"] for c in parties] == ["xds", "scaler", "envoy", "extproc"]
    for container in parties:
        assert _token_env(container) == {"secretKeyRef": {"name": "wg-wakegate-internal-token", "key": "token"}}
        # The token travels only by environment: no argument names it, no flag turns auth off.
        assert not any("token" in arg or "no-internal-auth" in arg for arg in container.get("args", []))
    # Envoy's bootstrap (a ConfigMap: no secret in it) reads the variable and sends it to the feeder.
    envoy = yaml.safe_load(by_kind(docs, "ConfigMap")["wg-wakegate-gateway-envoy"]["data"]["envoy.yaml"])
    from_env = {"environment_variable": "WAKEGATE_INTERNAL_TOKEN"}
    assert envoy["static_resources"]["secrets"] == [
        {"name": "wakegate_internal_token", "generic_secret": {"secret": from_env}}
    ]
    (xds_cluster,) = [c for c in envoy["static_resources"]["clusters"] if c["name"] == "wakegate_xds"]
    filters = xds_cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"][
        "http_filters"
    ]
    assert [f["name"] for f in filters] == [
        "envoy.filters.http.credential_injector",
        "envoy.filters.http.upstream_codec",
    ]

    policies = by_kind(docs, "NetworkPolicy")
    gateway_pods = {
        "app.kubernetes.io/name": "wakegate",
        "app.kubernetes.io/instance": "wg",
        "app.kubernetes.io/component": "gateway",
    }
    gateway_labels = deployments["wg-wakegate-gateway"]["spec"]["template"]["metadata"]["labels"]
    assert gateway_pods.items() <= gateway_labels.items()
    for name, guarded, open_ports in (("wg-wakegate-xds", 18000, {9201}), ("wg-wakegate-scaler", 9090, {9091, 8080})):
        spec = policies[name]["spec"]
        target = deployments[name]["spec"]["template"]["metadata"]["labels"]
        assert spec["podSelector"]["matchLabels"].items() <= target.items()
        assert spec["policyTypes"] == ["Ingress"]
        restricted, unrestricted = spec["ingress"]
        assert restricted["from"] == [{"podSelector": {"matchLabels": gateway_pods}}]
        assert restricted["ports"] == [{"protocol": "TCP", "port": guarded}]
        assert "from" not in unrestricted and {p["port"] for p in unrestricted["ports"]} == open_ports
        container_ports = {
            p["containerPort"] for c in deployments[name]["spec"]["template"]["spec"]["containers"] for p in c["ports"]
        }
        assert {guarded} | open_ports <= container_ports


def test_components_can_be_disabled(helm: Path, tmp_path: Path) -> None:
    docs = template(helm, tmp_path, {**DISABLED, "gateway": {"replicas": 1}, "dashboards": {"enabled": False}})
    assert set(by_kind(docs, "Deployment")) == {"wg-wakegate-gateway"}
    assert not by_kind(docs, "DaemonSet") and not by_kind(docs, "PodDisruptionBudget")
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ConfigMap").keys() - {"wg-wakegate-gateway-envoy"}


@pytest.mark.parametrize(
    ("values", "error"),
    [
        ({"gateway": {"replicas": 0}}, "/gateway/replicas"),
        ({"gateway": {"service": {"type": "Ingress"}}}, "/gateway/service/type"),
        ({"xds": {"port": 70000}}, "/xds/port"),
        ({"operator": {"replicas": "two"}}, "/operator/replicas"),
        ({"apiKey": "sk-in-clear"}, "additional properties 'apiKey'"),
        ({"gateway": {"apiKeys": {"value": "sk-in-clear"}}}, "additional properties 'value'"),
        ({"internalToken": {"value": "in-clear"}}, "additional properties 'value'"),
        ({"networkPolicy": {"enabled": "yes"}}, "/networkPolicy/enabled"),
        ({"metrics": {"serviceMonitor": {"interval": "soon"}}}, "/metrics/serviceMonitor/interval"),
        ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
        ({"gateway": {"publicMetrics": False}}, "/gateway/publicMetrics"),  # a bare `off` in YAML
        ({"gateway": {"publicMetrics": "public"}}, "/gateway/publicMetrics"),
    ],
)
def test_schema_rejects_bad_values(helm: Path, tmp_path: Path, values: dict[str, Any], error: str) -> None:
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(values))
    out = run(helm, "template", "wg", str(CHART), "-f", str(tmp_path / "bad.yaml"), check=False)
    assert out.returncode != 0
    assert error in out.stderr, out.stderr


def test_helm_binary_is_the_pinned_release(helm: Path) -> None:
    assert helm == HELM
    assert "v3.22.0" in run(helm, "version", "--short").stdout


def test_gateway_prestop_drains_envoy_and_waits_for_streams(helm: Path, tmp_path: Path) -> None:
    """The envoy container's preStop, run by bash against a real gateway's Envoy: the listener closes at
    once, the hook returns only when the running stream has finished, and that stream completes."""
    spec = by_kind(template(helm, tmp_path), "Deployment")["wg-wakegate-gateway"]["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] == 35  # drainSeconds (30) + 5
    envoy = next(c for c in spec["containers"] if c["name"] == "envoy")
    shell, flag, script = envoy["lifecycle"]["preStop"]["exec"]["command"]
    assert (shell, flag) == ("/bin/bash", "-c")
    assert script.startswith("admin=9901; drain=30\n")
    admin = free_port()
    models = model_doc("solo", extra='  args: ["--tokens-per-second", "20"]\n')
    up = UpProcess(tmp_path, models, "--envoy-admin-listen", f"127.0.0.1:{admin}")
    try:
        up.wait_ready({"solo": 1})
        body = {"model": "solo", "stream": True, "max_tokens": 60, "messages": [{"role": "user", "content": "x"}]}
        conn = http.client.HTTPConnection("127.0.0.1", up.port, timeout=30)
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        response = conn.getresponse()  # a 3 s stream
        assert response.status == 200
        started = time.monotonic()
        hook = subprocess.Popen([shell, flag, script.replace("admin=9901", f"admin={admin}")])
        time.sleep(0.5)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", up.port), timeout=5).close()
        assert hook.poll() is None  # still waiting: the stream runs
        assert response.read().rstrip().endswith(b"data: [DONE]")
        assert hook.wait(30) == 0
        assert time.monotonic() - started >= 2.0
        conn.close()
    finally:
        up.stop()


def _component_args(docs: list[dict[str, Any]], deployment: str, container: str) -> list[str]:
    spec = by_kind(docs, "Deployment")[deployment]["spec"]["template"]["spec"]
    return list(next(c for c in spec["containers"] if c["name"] == container)["args"])


@pytest.mark.parametrize(
    ("values", "native"),
    [
        ({}, True),
        ({"gateway": {"apiKeys": {"existingSecret": "keys"}}}, False),
        ({"gateway": {"globalRps": 50}}, False),
        ({"gateway": {"globalRps": 0.5}}, False),
    ],
)
def test_native_path_only_where_the_gateway_checks_no_keys_and_no_global_limit(
    helm: Path, tmp_path: Path, values: dict[str, Any], native: bool
) -> None:
    """Envoy's native routes check neither: feeder and operator agree, and extproc counts its Envoy's
    native requests over the pod's loopback, at the admin port the bootstrap gives Envoy."""
    docs = template(helm, tmp_path, values)
    flag = "--native-path" if native else "--no-native-path"
    assert flag in _component_args(docs, "wg-wakegate-xds", "xds")
    assert flag in _component_args(docs, "wg-wakegate-operator", "operator")
    extproc = _component_args(docs, "wg-wakegate-gateway", "extproc")
    counting = [a for a in extproc if a.startswith("--envoy-admin=")]
    assert counting == (["--envoy-admin=127.0.0.1:9901"] if native else [])
    bootstrap = yaml.safe_load(by_kind(docs, "ConfigMap")["wg-wakegate-gateway-envoy"]["data"]["envoy.yaml"])
    admin = bootstrap["admin"]["address"]["socket_address"]
    assert (admin["address"], admin["port_value"]) == ("127.0.0.1", 9901)


def _readme_table(heading: str) -> list[list[str]]:
    """The rows of the first table after the paragraph starting with `heading` in the chart's README."""
    text = (CHART / "README.md").read_text()
    rest = text[text.index(heading):]
    lines = rest[rest.index("\n|"):].strip().splitlines()
    table = list(itertools.takewhile(lambda line: line.startswith("|"), lines))
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in table[2:]]


def test_readme_lists_every_crd_the_chart_installs() -> None:
    files = [yaml.safe_load(path.read_text())["spec"] for path in sorted((CHART / "crds").glob("*.yaml"))]
    shipped = {(s["names"]["kind"], s["names"]["shortNames"][0], s["scope"].lower()) for s in files}
    listed = {(kind.strip("`"), short.strip("`"), scope) for kind, short, scope, *_ in _readme_table("**CRDs**")}
    assert listed == shipped


def test_readme_rbac_table_is_what_the_chart_renders(helm: Path, tmp_path: Path) -> None:
    """Every row of the README's RBAC table is a rule the chart renders, and every rendered rule is a
    row; a row's `when` value set to false removes exactly the rows that name it."""
    rows = {
        (component, scope, group.strip('"'), resources, verbs): frozenset(w.strip(" `") for w in when.split(",") if w)
        for component, scope, group, resources, verbs, when in _readme_table("**RBAC.**")
    }

    def rendered(values: dict[str, Any] | None) -> set[tuple[str, str, str, str, str]]:
        docs = template(helm, tmp_path, values)
        found = set()
        for kind, scope in (("ClusterRole", "cluster"), ("Role", "release namespace")):
            for name, role in by_kind(docs, kind).items():
                component = name.removeprefix("wg-wakegate-")
                for rule in role["rules"]:
                    for group in rule["apiGroups"]:
                        found.add((component, scope, group, ", ".join(rule["resources"]), ", ".join(rule["verbs"])))
        return found

    assert rendered(None) == set(rows)
    for switch in sorted(set().union(*rows.values())):
        values: dict[str, Any] = {}
        *parents, leaf = switch.split(".")
        node = values
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = False
        assert rendered(values) == {row for row, when in rows.items() if switch not in when}, switch
