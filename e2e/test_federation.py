"""Federation on two real control planes: a FederatedModel placed in both, one global endpoint.

The session's cluster is `east` and also the federation's own cluster (its API server holds
the Cluster and FederatedModel objects and the members' kubeconfig Secrets); a second control
plane started here is `west`. Each member runs the cluster form of wakegate (operator, `wakegate
xds`, extproc, Envoy) on its own loopback ports; `wakegate federation controller` writes the
Model into both and the statuses back; `wakegate federation gateway` is the global endpoint.
"""

from __future__ import annotations

import base64
import contextlib
import json
import signal
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from e2e.cluster import Cluster
from e2e.gateway import Gateway, Operator, install_crds, python_env, running
from e2e.helpers import Kube
from e2e.procs import Proc
from tests.support.federation import GlobalProcess, chat
from tests.support.http import Response
from tests.support.waiting import wait_for
from wakegate.control.admin import free_port

pytestmark = pytest.mark.e2e

GROUP, VERSION = "wakegate.io", "v1alpha1"
INTERVAL = 0.5


@pytest.fixture
def west(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A second control plane beside the session's, on its own ports and pod range (one node)."""
    started = Cluster(tmp_path_factory.mktemp("west"), nodes=1)
    started.start()
    try:
        yield started
    finally:
        started.stop()


def kubectl(kubeconfig: Path, *args: str) -> str:
    done = subprocess.run(
        ["kubectl", "--kubeconfig", str(kubeconfig), *args], capture_output=True, text=True, timeout=60, check=True
    )
    return done.stdout


def member_phase(custom: client.CustomObjectsApi, ns: str) -> str:
    try:
        body = custom.get_namespaced_custom_object(GROUP, VERSION, ns, "models", "chat")
    except client.ApiException:
        return ""
    return str((body.get("status") or {}).get("phase", ""))



def federation_objects(
    ns: str, suffix: str, gateways: dict[str, Gateway], low: int = 1, placement: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    objects: list[dict[str, Any]] = [
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "Cluster",
            "metadata": {"name": f"{name}-{suffix}", "labels": {"federation": suffix}},
            "spec": {
                "gateway": {"url": gateway.url},
                "region": name,
                "kubeconfig": {"namespace": ns, "name": f"kubeconfig-{name}", "key": "kubeconfig"},
            },
        }
        for name, gateway in gateways.items()
    ]
    scaling = {"min": low, "max": 1, "engine": "builtin", "idleTimeout": 300, "activationTimeout": 90}
    objects.append(
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "FederatedModel",
            "metadata": {"name": "chat", "namespace": ns},
            "spec": {
                "template": {"backend": "sim", "scaling": scaling},
                "placement": {"clusterSelector": {"federation": suffix}, "min": low, "max": 1, **(placement or {})},
            },
        }
    )
    return objects


@dataclass
class Federation:
    """Two member clusters running wakegate, and the federation controller over them."""

    kube: Kube
    west_custom: client.CustomObjectsApi
    ns: str
    suffix: str
    gateways: dict[str, Gateway]
    tmp: Path

    @property
    def key(self) -> str:
        return f"{self.ns}/chat"  # the FederatedModel's key: namespaced on a cluster

    def apply(self, objects: list[dict[str, Any]]) -> None:
        done = subprocess.run(
            ["kubectl", "--kubeconfig", str(self.kube.cluster.kubeconfig), "apply", "-f", "-"],
            input=yaml.safe_dump_all(objects),
            text=True,
            capture_output=True,
            timeout=60,
        )
        assert done.returncode == 0, f"kubectl apply failed: {done.stderr.strip()}"

    def summary(self) -> str:
        body = self.kube.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, "federatedmodels", "chat")
        return str((body.get("status") or {}).get("summary", ""))

    def member(self, answer: Response) -> str:
        by_port = {gateway.port: name for name, gateway in self.gateways.items()}
        return by_port[int(answer.headers["x-wakegate-upstream"].rsplit(":", 1)[1])]

    def global_gateway(self) -> GlobalProcess:
        """The global gateway over both member gateways, reading its GlobalProxy, the Clusters and
        the FederatedModels from the federation cluster."""

        def proxy(port: int) -> list[str]:
            body = {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "GlobalProxy",
                "metadata": {"name": "global", "namespace": self.ns},
                "spec": {
                    "listeners": [{"address": "127.0.0.1", "port": port}],
                    "healthCheck": {"intervalSeconds": INTERVAL, "timeoutSeconds": INTERVAL},
                },
            }
            self.kube.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, "globalproxies", body)
            kubeconfig = str(self.kube.cluster.kubeconfig)
            return ["--kubeconfig", kubeconfig, "--proxy", f"{self.ns}/global", "--refresh", "1"]

        return GlobalProcess(self.tmp, source=proxy)


@contextmanager
def federation(kube: Kube, west: Cluster, tmp_path: Path, *, scalers: bool = False) -> Iterator[Federation]:
    """East (the session's cluster, also the federation's) and west, each with its operator,
    feeder, extproc and Envoy (and, with `scalers`, its builtin scaler fed by its gateway's
    demand), the members' kubeconfigs in Secrets, and `wakegate federation controller`."""
    ns = kube.ns
    # A letter first: a bare hex run like "830e12" is a number to kubectl's YAML, and a label value
    # must be a string.
    suffix = f"f{uuid.uuid4().hex[:6]}"
    install_crds(kube.api)
    with west.api_client() as west_api:
        install_crds(west_api)
        west_core = client.CoreV1Api(west_api)
        west_core.create_namespace({"metadata": {"name": ns}})
        wait_for(
            lambda: any(sa.metadata.name == "default" for sa in west_core.list_namespaced_service_account(ns).items),
            30,
            "west's default service account",
        )
        members = {"east": kube.cluster, "west": west}
        things: list[Operator | Gateway] = []
        gateways: dict[str, Gateway] = {}
        scaler_procs: list[Proc] = []
        for name, cluster in members.items():
            kube.core.create_namespaced_secret(
                ns,
                {
                    "metadata": {"name": f"kubeconfig-{name}"},
                    "data": {"kubeconfig": base64.b64encode(cluster.kubeconfig.read_bytes()).decode()},
                },
            )
            folder = tmp_path / name
            folder.mkdir()
            demand = f"127.0.0.1:{free_port()}" if scalers else None
            gateways[name] = Gateway(folder, cluster.kubeconfig, demand=demand)
            things.append(Operator(folder, cluster.kubeconfig, ns, f"operator-{name}", ["--renew-seconds", "1"]))
            if demand is not None:
                scaler_procs.append(scaler(folder, cluster.kubeconfig, ns, demand, gateways[name].token))
        controller = Proc(
            "federation",
            [
                "python", "-m", "wakegate", "federation", "controller", "--kubeconfig", str(kube.cluster.kubeconfig),
                "--interval", "1", "--probe-timeout", "1",
            ],
            tmp_path / "federation.log",
            env=python_env(),
        )  # fmt: skip
        with running(*things, *gateways.values()):
            for proc in [*scaler_procs, controller]:
                proc.start()
            try:
                yield Federation(kube, client.CustomObjectsApi(west_api), ns, suffix, gateways, tmp_path)
            finally:
                for proc in [controller, *scaler_procs]:
                    proc.stop()
                for name in members:  # cluster-scoped: the namespace's deletion does not take them
                    with contextlib.suppress(client.ApiException):
                        kube.custom.delete_cluster_custom_object(GROUP, VERSION, "clusters", f"{name}-{suffix}")
        west_core.delete_namespace(ns)


def scaler(folder: Path, kubeconfig: Path, ns: str, demand: str, token: Path) -> Proc:
    """`wakegate scaler` (the builtin engine) for one member, fed by its gateway's demand reports."""
    return Proc(
        "scaler",
        [
            "python", "-m", "wakegate", "scaler", "--kubeconfig", str(kubeconfig), "--demand-listen", demand,
            "--keda-listen", f"127.0.0.1:{free_port()}", "--admin-listen", f"127.0.0.1:{free_port()}",
            "--lease-namespace", ns, "--internal-token-file", str(token),
        ],
        folder / "scaler.log",
        env=python_env(),
    )  # fmt: skip


def test_a_federated_model_in_two_clusters_spreads_follows_scale_to_zero_and_survives_a_gateway_loss(
    kube: Kube, west: Cluster, tmp_path: Path
) -> None:
    with federation(kube, west, tmp_path) as fed:
        ns, suffix, gateways = fed.ns, fed.suffix, fed.gateways
        glob: GlobalProcess | None = None
        try:
            started = time.monotonic()
            objects = federation_objects(ns, suffix, gateways)
            fed.apply(objects)
            wait_for(lambda: member_phase(kube.custom, ns) == "Ready", 120, "east's Model Ready", every=0.5)
            wait_for(lambda: member_phase(fed.west_custom, ns) == "Ready", 120, "west's Model Ready", every=0.5)
            placed_after = time.monotonic() - started
            want = f"east-{suffix}=Ready west-{suffix}=Ready"
            wait_for(lambda: fed.summary() == want, 60, "both clusters Ready in the FederatedModel", every=0.5)
            listed = kubectl(kube.cluster.kubeconfig, "get", "clusters,federatedmodels", "-n", ns)
            assert f"east-{suffix}" in listed and "True" in listed and want in listed, listed
            east_status = kube.custom.get_cluster_custom_object(GROUP, VERSION, "clusters", f"east-{suffix}")["status"]
            assert east_status["reachable"] == "True" and east_status["readyModels"] >= 1
            assert set(east_status["gpus"]) == {"total", "allocated"}  # the member's capacity summary
            member_models = kube.custom.get_namespaced_custom_object(GROUP, VERSION, ns, "models", "chat")
            managers = {m["manager"] for m in member_models["metadata"]["managedFields"]}
            assert "wakegate-federation" in managers

            glob = fed.global_gateway()
            key = fed.key
            both = sorted([f"east-{suffix}", f"west-{suffix}"])
            glob.wait_for(lambda s: s["routes"][key] == both, timeout=60)
            spread = Counter(fed.member(chat(glob.url, "chat")) for _ in range(20))
            assert spread["east"] >= 3 and spread["west"] >= 3, spread

            # East's Model scaled to zero (as its scaler would): the global gateway routes to west.
            scaled = time.monotonic()
            kubectl(kube.cluster.kubeconfig, "-n", ns, "scale", "deployment", "wg-chat", "--replicas=0")
            glob.wait_for(lambda s: s["routes"][key] == [f"west-{suffix}"], timeout=60)
            rerouted_after_scale = time.monotonic() - scaled
            assert {fed.member(chat(glob.url, "chat")) for _ in range(8)} == {"west"}
            kubectl(kube.cluster.kubeconfig, "-n", ns, "scale", "deployment", "wg-chat", "--replicas=1")
            glob.wait_for(lambda s: s["routes"][key] == both, timeout=90)

            # West's gateway stopped mid-run: nothing that had not reached it fails.
            sent: list[tuple[float, int, str]] = []
            stop_at = time.monotonic() + 6.0

            def worker() -> None:
                while time.monotonic() < stop_at:
                    began = time.monotonic()
                    answer = chat(glob.url, "chat")
                    sent.append((began, answer.status, answer.text[:160]))

            threads = [threading.Thread(target=worker) for _ in range(3)]
            for thread in threads:
                thread.start()
            time.sleep(2.0)
            killed = time.monotonic()
            envoy = gateways["west"].envoy.popen
            assert envoy is not None
            envoy.send_signal(signal.SIGKILL)
            envoy.wait()
            gone = time.monotonic()
            glob.wait_for(lambda s: s["routes"][key] == [f"east-{suffix}"], timeout=10)
            rerouted = time.monotonic() - killed
            for thread in threads:
                thread.join(60)
            after = [s for s in sent if s[0] >= gone]
            failed = [s for s in sent if s[1] != 200]
            assert after and not [s for s in after if s[1] != 200], failed[:3]
            assert all("connection termination" in s[2] for s in failed), failed[:3]
            status = glob.status()

            def proxy_status() -> dict[str, Any]:
                body = kube.custom.get_namespaced_custom_object(GROUP, VERSION, ns, "globalproxies", "global")
                return dict(body.get("status") or {})

            wait_for(lambda: proxy_status() == {"members": 2, "healthyMembers": 1}, 10, "the GlobalProxy's status")
            stat = "model_" + key.replace("/", "_").replace("-", "_")
            retries = glob.envoy_stats(stat + r"\.upstream_(rq_retry|rq_retry_success)$")
            print(
                "\nfederation e2e: "
                + json.dumps(
                    {
                        "placed_ready_s": round(placed_after, 1),
                        "spread": dict(spread),
                        "reroute_after_scale_to_zero_s": round(rerouted_after_scale, 2),
                        "requests": len(sent),
                        "after_gateway_gone": len(after),
                        "failed": len(failed),
                        "reroute_after_gateway_loss_s": round(rerouted, 2),
                        "route_failovers": status["counters"]["failovers"],
                        "envoy_retries": retries,
                    }
                )
            )
            print(listed)

            # Placed in east only from now on: the controller removes the Model it wrote in west.
            kube.custom.patch_namespaced_custom_object(
                GROUP, VERSION, ns, "federatedmodels", "chat",
                {"spec": {"placement": {"clusterSelector": None, "clusters": [f"east-{suffix}"]}}},
            )  # fmt: skip
            wait_for(lambda: member_phase(fed.west_custom, ns) == "", 30, "west's Model removed", every=0.5)
            assert member_phase(kube.custom, ns) == "Ready"
            wait_for(lambda: fed.summary() == f"east-{suffix}=Ready", 30, "the FederatedModel placed in east only")
        finally:
            if glob is not None:
                glob.stop()


def replicas(api: Any, ns: str) -> int:
    """The member backend Deployment's replicas (0 when it has none yet)."""
    apps = client.AppsV1Api(api)
    try:
        return int(apps.read_namespaced_deployment("wg-chat", ns).spec.replicas or 0)
    except client.ApiException:
        return 0


def test_a_model_cold_in_both_clusters_wakes_in_one_only(kube: Kube, west: Cluster, tmp_path: Path) -> None:
    with federation(kube, west, tmp_path, scalers=True) as fed:
        ns, suffix = fed.ns, fed.suffix
        fed.apply(federation_objects(ns, suffix, fed.gateways, low=0, placement={"failover": [f"east-{suffix}"]}))
        idle = f"east-{suffix}=Idle west-{suffix}=Idle"
        wait_for(lambda: fed.summary() == idle, 90, "the model placed and idle in both", every=0.5)
        glob = fed.global_gateway()
        try:
            glob.wait_for(lambda s: s["routes"][fed.key] == [] and len(s["members"]) >= 2, timeout=60)
            started = time.monotonic()
            with ThreadPoolExecutor(3) as pool:
                answers = list(pool.map(lambda _: chat(glob.url, "chat"), range(3)))
            cold = time.monotonic() - started
            assert [a.status for a in answers] == [200] * 3, [a.text for a in answers]
            assert {fed.member(a) for a in answers} == {"east"}  # first in failover order
            assert glob.status()["counters"]["wakes"] == {fed.key: 1}
            with west.api_client() as west_api:
                assert replicas(west_api, ns) == 0  # one activation, not one per cluster
            print(f"\nfederation e2e cold: three held requests answered in {cold:.1f}s by one woken cluster")
        finally:
            glob.stop()
