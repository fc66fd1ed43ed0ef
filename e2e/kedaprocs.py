"""KEDA on the harness: its operator and its metrics API server as local processes.

Both are built from KEDA's Go module by e2e/keda/build.sh (`operator`, `adapter`) into
e2e/.bin; tests skip when a binary is absent. They run with the admin kubeconfig and watch one
namespace (`WATCH_NAMESPACE`), so they never act on other tests' objects.

* The operator keeps its metrics gRPC service (what the adapter asks for metric values) on
  127.0.0.1 with a certificate from `cert_dir` (server and client auth: KEDA's services use one
  pair both ways). `hosts` maps names to addresses for the operator alone (a private mount
  namespace with its own /etc/hosts): the harness has no cluster DNS, and KEDA must dial the
  scaler by the Service name its certificate carries, as it would on a real cluster.
* The adapter serves `v1beta1.external.metrics.k8s.io` for the apiserver's aggregation layer
  (e2e/cluster.py runs the apiserver with the front-proxy client certificate and
  `--enable-aggregator-routing`): it listens on the root-namespace side of node 0's veth (pod
  networking, e2e/net.py: a non-loopback address the apiserver may route to), behind a
  selector-less Service whose Endpoints name that address, registered as an APIService with the
  CA in its caBundle.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

from kubernetes import client
from kubernetes.client.rest import ApiException

from e2e.cluster import Cluster
from e2e.pki import PKI
from e2e.procs import Proc
from tests.support.waiting import wait_for
from wakegate.control.admin import free_port

REPO = Path(__file__).resolve().parents[1]
OPERATOR_BIN = REPO / "e2e" / ".bin" / "keda-operator"
ADAPTER_BIN = REPO / "e2e" / ".bin" / "keda-adapter"
NAMESPACE = "keda"
ADAPTER_SERVICE = "keda-metrics-apiserver"
EXTERNAL_METRICS = "v1beta1.external.metrics.k8s.io"
EVENTING_CRDS = ("eventing.keda.sh_cloudeventsources.yaml", "eventing.keda.sh_clustercloudeventsources.yaml")


def module_dir() -> Path:
    from e2e.build import KEDA_MODULE, KEDA_VERSION

    out = subprocess.run(
        ["go", "mod", "download", "-json", f"{KEDA_MODULE}@{KEDA_VERSION}"],
        check=True,
        capture_output=True,
        text=True,
        cwd="/tmp",
    ).stdout
    return Path(json.loads(out)["Dir"])


def _create(call: object, *args: object) -> None:
    try:
        call(*args)  # type: ignore[operator]
    except ApiException as exc:
        if exc.status != 409:
            raise


def prepare(api: client.ApiClient) -> None:
    """What the operator needs beyond the harness's keda.sh CRDs: its eventing CRDs and namespace."""
    import yaml

    ext = client.ApiextensionsV1Api(api)
    for name in EVENTING_CRDS:
        body = yaml.safe_load((module_dir() / "config" / "crd" / "bases" / name).read_text())
        _create(ext.create_custom_resource_definition, body)
    _create(client.CoreV1Api(api).create_namespace, {"metadata": {"name": NAMESPACE}})


def certificates(directory: Path, extra_sans: tuple[str, ...] = ()) -> PKI:
    """`tls.crt`/`tls.key`/`ca.crt` in `directory`, as KEDA's --cert-dir wants them."""
    pki = PKI(directory)
    names = ("keda-operator", f"keda-operator.{NAMESPACE}.svc", f"{ADAPTER_SERVICE}.{NAMESPACE}.svc", *extra_sans)
    served = pki.issue("tls", "keda-operator", server=True, client=True, extra_sans=names)
    assert served.cert.name == "tls.crt" and (pki.dir / "ca.crt").exists()
    return pki


def operator(
    cluster: Cluster, watch: str, cert_dir: Path, log: Path, hosts: Mapping[str, str] | None = None
) -> tuple[Proc, int]:
    """KEDA's operator (not started) and the port of its metrics gRPC service."""
    metrics_service = free_port()
    env = dict(
        os.environ,
        KUBECONFIG=str(cluster.kubeconfig),
        POD_NAMESPACE=NAMESPACE,
        WATCH_NAMESPACE=watch,
        KEDA_CLUSTER_OBJECT_NAMESPACE=NAMESPACE,
    )
    argv = [
        str(OPERATOR_BIN),
        f"--metrics-bind-address=127.0.0.1:{free_port()}",
        f"--health-probe-bind-address=127.0.0.1:{free_port()}",
        f"--metrics-service-bind-address=127.0.0.1:{metrics_service}",
        f"--cert-dir={cert_dir}",
        "--enable-cert-rotation=false",
        "--enable-webhook-patching=false",
        "--enable-apiservice-patching=false",
        "--zap-log-level=info",
    ]
    if hosts:
        table = log.with_suffix(".hosts")
        lines = Path("/etc/hosts").read_text().rstrip("\n").splitlines()
        table.write_text("\n".join([*lines, *(f"{ip} {name}" for name, ip in hosts.items())]) + "\n")
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                f'mount --bind "{table}" /etc/hosts && exec "$0" "$@"', *argv]
    return Proc("keda-operator", argv, log, env=env), metrics_service


def wait_operator(proc: Proc) -> None:
    wait_for(lambda: "Starting workers" in proc.tail(200) or proc.exited() is not None, 90, "KEDA operator")
    assert proc.exited() is None, proc.tail(60)


def adapter(cluster: Cluster, watch: str, cert_dir: Path, metrics_service: int, log: Path) -> tuple[Proc, str, int]:
    """KEDA's metrics API server (not started), and the address and port it serves on."""
    assert cluster.network is not None, "the cluster's pod network"
    address = cluster.network.nodes[0].gateway
    port = free_port()
    kubeconfig = str(cluster.kubeconfig)
    env = dict(os.environ, KUBECONFIG=kubeconfig, POD_NAMESPACE=NAMESPACE, WATCH_NAMESPACE=watch,
               KEDA_CLUSTER_OBJECT_NAMESPACE=NAMESPACE)
    argv = [
        str(ADAPTER_BIN),
        f"--secure-port={port}",
        f"--bind-address={address}",
        f"--cert-dir={cert_dir}",
        f"--tls-cert-file={cert_dir / 'tls.crt'}",
        f"--tls-private-key-file={cert_dir / 'tls.key'}",
        f"--lister-kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--metrics-service-address=127.0.0.1:{metrics_service}",
        f"--port={free_port()}",
        "--zap-log-level=info",
    ]
    return Proc("keda-adapter", argv, log, env=env), address, port


def register_adapter(api: client.ApiClient, address: str, port: int, ca: Path) -> None:
    """The adapter behind a Service (Endpoints by hand) and the external metrics APIService; waits
    until the aggregator reports it Available."""
    core = client.CoreV1Api(api)
    _create(core.create_namespaced_service, NAMESPACE, {
        "metadata": {"name": ADAPTER_SERVICE},
        "spec": {"ports": [{"name": "https", "port": 443, "targetPort": port}]},
    })
    _create(core.create_namespaced_endpoints, NAMESPACE, {
        "metadata": {"name": ADAPTER_SERVICE},
        "subsets": [{"addresses": [{"ip": address}], "ports": [{"name": "https", "port": port}]}],
    })
    registration = client.ApiregistrationV1Api(api)
    _create(registration.create_api_service, {
        "metadata": {"name": EXTERNAL_METRICS},
        "spec": {
            "group": "external.metrics.k8s.io",
            "version": "v1beta1",
            "service": {"name": ADAPTER_SERVICE, "namespace": NAMESPACE, "port": 443},
            "caBundle": base64.b64encode(ca.read_bytes()).decode(),
            "groupPriorityMinimum": 100,
            "versionPriority": 100,
        },
    })

    def available() -> bool:
        status = registration.read_api_service(EXTERNAL_METRICS).status
        return any(c.type == "Available" and c.status == "True" for c in (status.conditions or []))

    wait_for(available, 90, f"APIService {EXTERNAL_METRICS} Available", every=1)
