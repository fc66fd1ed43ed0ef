"""The cluster form of wakegate on this machine, for e2e tests: operator, `wakegate xds`, Envoy and extproc.

The operator and the feeder run as host processes with the cluster's admin
kubeconfig; the gateway (Envoy + extproc) gets no Kubernetes credentials at all
and learns everything over ADS from the feeder, reaching pods at their pod IPs.
Envoy's bootstrap is the project's template, rendered by wakegate.control.bootstrap as
`wakegate up` renders it.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client import ApiClient

from e2e.procs import Proc
from wakegate import internal_token
from wakegate.control import bootstrap
from wakegate.control.admin import free_port

REPO = Path(__file__).resolve().parent.parent
CRD_DIR = REPO / "charts" / "wakegate" / "crds"


def install_crds(api: ApiClient) -> None:
    """Apply the committed wakegate CRDs (idempotent) and wait until they are established."""
    ext = client.ApiextensionsV1Api(api)
    for path in sorted(CRD_DIR.glob("*.yaml")):
        body = yaml.safe_load(path.read_text())
        api.call_api(
            "PATCH",
            api.configuration.host
            + f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{body['metadata']['name']}"
            + "?fieldManager=e2e&force=true",
            header_params=_auth(api, {"Content-Type": "application/apply-patch+yaml", "Accept": "application/json"}),
            body=body,
        ).read()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            crd = ext.read_custom_resource_definition(body["metadata"]["name"])
            if any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or []):
                break
            time.sleep(0.2)
        _wait_served(api, body, deadline)


def _wait_served(api: ApiClient, crd: dict[str, Any], deadline: float) -> None:
    """Wait until the apiserver lists `crd`'s objects: an Established CRD's storage may still be
    initialising (a 429) for seconds on a busy machine, and what starts then meets that first."""
    group, plural = crd["spec"]["group"], crd["spec"]["names"]["plural"]
    version = next(v["name"] for v in crd["spec"]["versions"] if v.get("served", True))
    custom = client.CustomObjectsApi(api)
    while True:
        try:
            custom.list_cluster_custom_object(group, version, plural, limit=1)
            return
        except client.ApiException as exc:
            if exc.status != 429 or time.monotonic() > deadline:
                raise
        time.sleep(0.2)


#: The read-only ClusterRole of `wakegate xds` (docs/operator.md).
XDS_RULES: list[dict[str, Any]] = [
    # LoRAAdapters: their names route to their base.
    {"apiGroups": ["wakegate.io"], "resources": ["models", "loraadapters"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
    # Nodes being drained or reclaimed: their endpoints leave the routes first.
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]},
    # Kopf's resource discovery watches CRDs to notice when Models become available.
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["list", "watch"]},
]
#: The operator's ClusterRole (docs/operator.md), and its Role for the Lease.
OPERATOR_RULES: list[dict[str, Any]] = [
    {"apiGroups": ["wakegate.io"], "resources": ["models"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["wakegate.io"], "resources": ["models/status"], "verbs": ["patch"]},
    {
        "apiGroups": ["wakegate.io"],
        "resources": ["inferenceruntimes"],
        "verbs": ["get", "list", "watch", "create", "patch"],
    },
    {
        "apiGroups": ["wakegate.io"],
        "resources": ["modelcaches"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {"apiGroups": ["wakegate.io"], "resources": ["modelcaches/status"], "verbs": ["patch"]},
    {"apiGroups": ["wakegate.io"], "resources": ["modelcatalogs"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["wakegate.io"], "resources": ["modelcatalogs/status"], "verbs": ["patch"]},
    {"apiGroups": ["wakegate.io"], "resources": ["loraadapters"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["wakegate.io"], "resources": ["loraadapters/status"], "verbs": ["patch"]},
    {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "list", "watch", "create", "patch"]},
    {"apiGroups": [""], "resources": ["services"], "verbs": ["create", "patch"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch", "delete"]},  # delete: Failed ones
    # The LoRA readiness gate of vLLM-style pods (one condition, server-side apply).
    {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
    {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": ["create", "patch", "delete"]},
    {
        "apiGroups": ["keda.sh"],
        "resources": ["scaledobjects", "triggerauthentications"],
        "verbs": ["create", "patch", "delete"],
    },
    {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["get", "list", "watch"],
    },
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]},
]
#: The node agent with its model cache (prewarm): the chart's agent ClusterRole, exactly.
AGENT_RULES: list[dict[str, Any]] = [
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]},
    {"apiGroups": ["wakegate.io"], "resources": ["models", "modelcaches"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["wakegate.io"], "resources": ["modelcaches/status"], "verbs": ["patch"]},
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]},
]
LEASE_RULES: list[dict[str, Any]] = [
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]},
]


@contextmanager
def scoped_kubeconfig(
    kube: Any, tmp: Path, account: str, cluster_rules: list[dict[str, Any]], ns_rules: Sequence[dict[str, Any]] = ()
) -> Iterator[Path]:
    """A kubeconfig with a bound token of a new service account holding exactly these rules."""
    rbac = client.RbacAuthorizationV1Api(kube.api)
    name = f"wakegate-{account}-{uuid.uuid4().hex[:6]}"
    kube.core.create_namespaced_service_account(kube.ns, {"metadata": {"name": account}})
    subjects = [{"kind": "ServiceAccount", "name": account, "namespace": kube.ns}]
    rbac.create_cluster_role({"metadata": {"name": name}, "rules": cluster_rules})
    rbac.create_cluster_role_binding(
        {
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": subjects,
        }
    )
    if ns_rules:
        rbac.create_namespaced_role(kube.ns, {"metadata": {"name": name}, "rules": list(ns_rules)})
        rbac.create_namespaced_role_binding(
            kube.ns,
            {
                "metadata": {"name": name},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
                "subjects": subjects,
            },
        )
    token = kube.core.create_namespaced_service_account_token(
        account, kube.ns, {"spec": {"expirationSeconds": 3600}}
    ).status.token
    admin = yaml.safe_load(kube.cluster.kubeconfig.read_text())
    cluster = admin["clusters"][0]["cluster"]
    if "certificate-authority" in cluster:
        ca = base64.b64encode(Path(cluster["certificate-authority"]).read_bytes()).decode()
        cluster = {"server": cluster["server"], "certificate-authority-data": ca}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "e2e", "cluster": cluster}],
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [{"name": account, "context": {"cluster": "e2e", "user": account}}],
        "current-context": account,
    }
    path = tmp / f"{account}-kubeconfig"
    path.write_text(yaml.safe_dump(config))
    try:
        yield path
    finally:
        rbac.delete_cluster_role_binding(name)
        rbac.delete_cluster_role(name)


def _auth(api: ApiClient, headers: dict[str, str]) -> dict[str, str]:
    api.update_params_for_auth(headers, [], ["BearerToken"], "", "PATCH", None)
    return headers


def python_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


class Operator:
    """`wakegate operator` as a host process (one replica of the leader-elected pair)."""

    def __init__(
        self, dir: Path, kubeconfig: Path, lease_namespace: str, name: str = "operator", extra: Sequence[str] = ()
    ) -> None:
        self.name = name
        self.proc = Proc(
            name,
            [
                sys.executable,
                "-m",
                "wakegate",
                "operator",
                "--kubeconfig",
                str(kubeconfig),
                "--lease-namespace",
                lease_namespace,
                "--identity",
                name,
                *extra,
            ],
            dir / f"{name}.log",
            env=python_env(),
        )

    def start(self) -> Operator:
        self.proc.start()
        return self

    def stop(self) -> None:
        self.proc.stop()


class Scaler:
    """`wakegate scaler` as a host process: the DemandService a Gateway reports to, its Lease in
    `lease_namespace`, Models (and backend pods) of every namespace, the builtin engine's writes."""

    def __init__(self, dir: Path, kubeconfig: Path, lease_namespace: str, token: Path, demand: str) -> None:
        self.demand = demand
        self.admin = f"127.0.0.1:{free_port()}"
        self.proc = Proc(
            "scaler",
            [
                sys.executable,
                *("-m", "wakegate", "scaler", "--kubeconfig", str(kubeconfig)),
                *("--demand-listen", self.demand, "--keda-listen", f"127.0.0.1:{free_port()}"),
                *("--admin-listen", self.admin, "--lease-namespace", lease_namespace),
                *("--internal-token-file", str(token)),
            ],
            dir / "scaler.log",
            env=python_env(),
        )

    def leads(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.admin}/metrics", timeout=2) as resp:
                return "wakegate_scaler_leader 1.0" in resp.read().decode()
        except OSError:
            return False

    def start(self) -> Scaler:
        self.proc.start()
        return self

    def stop(self) -> None:
        self.proc.stop()


class Gateway:
    """`wakegate xds` (with the kubeconfig) + extproc + Envoy (without), on free loopback ports."""

    def __init__(self, dir: Path, kubeconfig: Path, demand: str | None = None, native: bool = False) -> None:
        """`native`: as the chart without API keys sets it up, the feeder lets Models take the native
        path and extproc counts its Envoy's native requests (`--native-path`, `--envoy-admin`)."""
        self.dir = dir
        self.port = free_port()
        self.xds_port = free_port()
        self.xds_admin = free_port()
        self.extproc_port = free_port()
        self.extproc_admin = free_port()
        self.activator_port = free_port()
        self.envoy_admin = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The internal token of this gateway and its feeder (owner-only, like `wakegate up`'s).
        self.token = internal_token.generate(dir / "secrets" / "internal-token")
        node_id = f"e2e-gateway-{os.getpid()}-{self.port}"
        env = python_env()
        gateway_env = {k: v for k, v in env.items() if k != "KUBECONFIG"}
        self.xds = Proc(
            "xds",
            [
                sys.executable,
                "-m",
                "wakegate",
                "xds",
                "--kubeconfig",
                str(kubeconfig),
                "--listen",
                f"127.0.0.1:{self.xds_port}",
                "--gateway-listen",
                f"127.0.0.1:{self.port}",
                "--upstream-header",
                "--internal-token-file",
                str(self.token),
                "--admin-listen",
                f"127.0.0.1:{self.xds_admin}",
                *(["--native-path"] if native else []),
            ],
            dir / "xds.log",
            env=env,
        )
        extproc_argv = [
            sys.executable,
            "-m",
            "wakegate.extproc",
            "--listen",
            f"127.0.0.1:{self.extproc_port}",
            "--admin-listen",
            f"127.0.0.1:{self.extproc_admin}",
            "--activator-listen",
            f"127.0.0.1:{self.activator_port}",
            "--xds",
            f"127.0.0.1:{self.xds_port}",
            "--internal-token-file",
            str(self.token),
            "--gateway-id",
            node_id,
        ]
        if demand is not None:
            extproc_argv += ["--demand", demand]
        if native:
            extproc_argv += ["--envoy-admin", f"127.0.0.1:{self.envoy_admin}"]
        self.extproc = Proc("extproc", extproc_argv, dir / "extproc.log", env=gateway_env)
        config = dir / "envoy.yaml"
        config.write_text(
            bootstrap.render(
                node_id,
                bootstrap.GatewayPorts(
                    envoy_admin=self.envoy_admin,
                    xds=self.xds_port,
                    extproc=self.extproc_port,
                    activator=self.activator_port,
                ),
                bootstrap.TokenRef(file=str(self.token)),
            )
        )
        self.envoy = Proc(
            "envoy",
            [
                bootstrap.envoy_binary(),
                *("-c", str(config), "--concurrency", "1", "--use-dynamic-base-id", "--log-level", "warn"),
            ],
            dir / "envoy.log",
            env=gateway_env,
        )

    @property
    def procs(self) -> Sequence[Proc]:
        return (self.xds, self.extproc, self.envoy)

    def start(self, timeout: float = 60.0) -> None:
        for proc in self.procs:
            proc.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.exited() is not None:
                    raise RuntimeError(f"{proc.name} exited {proc.exited()}:\n{proc.tail()}")
            if _get(f"http://127.0.0.1:{self.envoy_admin}/ready") == 200 and _listening(self.port):
                return
            time.sleep(0.2)
        raise RuntimeError(f"gateway not ready in {timeout}s:\n" + "\n".join(p.tail(10) for p in self.procs))

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()

    def chat(self, model: str, timeout: float = 30.0) -> tuple[int, dict[str, Any]]:
        body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        return post_json(f"{self.url}/v1/chat/completions", body, timeout=timeout)


def post_json(
    url: str, body: Mapping[str, Any], headers: Mapping[str, str] | None = None, timeout: float = 30.0
) -> tuple[int, dict[str, Any]]:
    """(status, decoded reply) of a JSON POST; an error reply that is not JSON comes back as {"raw": text}."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        raw = err.read()
        err.close()
        try:
            return err.code, json.loads(raw)
        except ValueError:
            return err.code, {"raw": raw.decode(errors="replace")}


def subscribe_without_token(address: str, token: str | None = None) -> str:
    """Open an ADS stream as a stranger would (no token, or `token`); the status name it ends with."""
    import grpc
    from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

    from wakegate import contract

    metadata = (("authorization", f"Bearer {token}"),) if token is not None else ()
    with grpc.insecure_channel(address) as channel:
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
        request = discovery_pb2.DiscoveryRequest(type_url=contract.MODEL_ROUTE_TYPE)
        try:
            for _ in stub.StreamAggregatedResources(iter([request]), metadata=metadata, timeout=10):
                return "OK"  # routes were sent: the stranger got in
        except grpc.RpcError as exc:
            return str(exc.code().name)
    return "OK"


def refused_streams(admin: str) -> float:
    """`wakegate_internal_auth_refused_total{service="ads"}` from a feeder's /metrics."""
    with urllib.request.urlopen(f"http://{admin}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith('wakegate_internal_auth_refused_total{service="ads"}'):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no refused-calls metric")


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return int(resp.status)
    except (urllib.error.URLError, OSError):
        return 0


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@contextmanager
def running(*things: Operator | Gateway | Scaler) -> Iterator[None]:
    try:
        for thing in things:
            thing.start()
        yield
    finally:
        for thing in reversed(things):
            thing.stop()
