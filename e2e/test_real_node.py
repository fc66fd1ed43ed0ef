"""Pods of the project's image on a real node: the kubelet, containerd and runc (e2e/node.py).

The image (e2e/image.py) is pushed to the tests' Distribution registry and pulled from it by
containerd; the kubelet runs its probes, mounts and security context for real.

On by default (WAKEGATE_E2E_REAL_NODE=0 leaves it out; docs/testing.md, "A real node": what it
adds to a run); the e2e session runs this module last (e2e/conftest.py). Own cluster (module
scope): one emulated node beside the real one.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from openai import OpenAI

from e2e import image
from e2e.cluster import Cluster
from e2e.helm import ensure_helm
from e2e.helpers import is_ready
from e2e.node import RealNode
from e2e.test_helm import (
    BASE_VALUES,
    CHART,
    COMPONENTS,
    GROUP,
    MODELS_NS,
    NS,
    RELEASE,
    VERSION,
    chat,
    merged,
    pods,
    ready_pod,
    run_helm,
    values_file,
)
from e2e.tinymodel import write_model
from e2e.tools.registry import start_registry
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.environ.get("WAKEGATE_E2E_REAL_NODE") == "0",
                       reason="WAKEGATE_E2E_REAL_NODE=0 leaves the real node out (docs/testing.md, 'A real node')"),
    pytest.mark.skipif(os.geteuid() != 0, reason="containerd, runc and network namespaces need root"),
]


#: the chart's default images: ghcr.io/wakegate/wakegate:<appVersion>, envoyproxy/envoy:<tag>
CHART_VERSION = str(yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"])
ENVOY_TAG = str(yaml.safe_load((CHART / "values.yaml").read_text())["gateway"]["envoy"]["image"]["tag"])


@dataclass
class Setup:
    cluster: Cluster
    node: RealNode
    #: the component image as pods name it: REGISTRY/wakegate/wakegate:TAG
    image: str
    #: this machine's own iptables rules before the node started
    host_rules: str


def host_rules() -> str:
    """This machine's iptables and ip6tables rules (filter, nat, mangle), as `-S` prints them."""
    return "".join(
        subprocess.run([tool, "-t", table, "-S"], capture_output=True, text=True, check=True).stdout
        for tool in ("iptables", "ip6tables")
        for table in ("filter", "nat", "mangle")
    )


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    built = image.ensure_image()
    with start_registry(tmp_path_factory.mktemp("registry")) as reg:
        pushed = image.push(built.image, reg.host, "wakegate/wakegate")
        cluster = Cluster(tmp_path_factory.mktemp("real-node-cluster"), nodes=1)
        cluster.start()
        node = RealNode(cluster, registry=reg.host)
        image.install_packages((*image.APT_PACKAGES, *image.NODE_APT_PACKAGES))  # iptables among them
        before = host_rules()
        try:
            node.start()
            yield Setup(cluster, node, pushed, before)
        finally:
            node.stop()
            cluster.stop()


@pytest.fixture
def core(real: Setup) -> Iterator[client.CoreV1Api]:
    with real.cluster.api_client() as api:
        yield client.CoreV1Api(api)


def _events(core: client.CoreV1Api, ns: str, pod: str) -> dict[str, str]:
    events = core.list_namespaced_event(ns, field_selector=f"involvedObject.name={pod}").items
    return {e.reason: e.message for e in events}


def _sim_pod(real: Setup, name: str) -> dict[str, Any]:
    probe = {"httpGet": {"path": "/health", "port": "http"}}
    return {
        "metadata": {"name": name},
        "spec": {
            "nodeName": real.node.name,
            "terminationGracePeriodSeconds": 5,
            "containers": [{
                "name": "sim", "image": real.image, "imagePullPolicy": "Always",
                "args": ["wakegate", "sim", "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "tiny"],
                "ports": [{"name": "http", "containerPort": 8000}],
                "startupProbe": {**probe, "periodSeconds": 1, "failureThreshold": 60},
                "livenessProbe": {**probe, "periodSeconds": 5},
                "readinessProbe": {**probe, "periodSeconds": 1},
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                "securityContext": {"runAsNonRoot": True, "readOnlyRootFilesystem": True,
                                    "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
            }],
            "volumes": [{"name": "tmp", "emptyDir": {}}],
        },
    }


def test_a_pod_of_the_image_pulled_from_the_registry_serves_the_sim_on_the_real_node(
    real: Setup, core: client.CoreV1Api, record_property: Any
) -> None:
    created = time.monotonic()
    core.create_namespaced_pod("default", _sim_pod(real, "sim"))
    pod: Any = wait_for(lambda: _if_ready(core.read_namespaced_pod("sim", "default")), 180,
                        "the sim pod Ready on the real node (startup and readiness probes by the kubelet)", every=0.5)
    started_s = time.monotonic() - created

    # The kubelet pulled it from the registry (its event says so, with the time the pull took).
    pulled = _events(core, "default", "sim").get("Pulled", "")
    assert real.image in pulled, pulled
    match = re.search(r"in ([\d.]+m?s)", pulled)
    record_property("pod_ready_s", round(started_s, 1))
    record_property("image_pull", match.group(1) if match else pulled)
    print(f"\nreal node: sim pod Ready {started_s:.1f}s after create; {pulled}")

    with OpenAI(base_url=f"http://{pod.status.pod_ip}:8000/v1", api_key="unused", max_retries=0, timeout=30) as ai:
        reply = ai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert reply.choices[0].message.content

    # The container's process as the host sees it: the image's user, not root.
    status = core.read_namespaced_pod("sim", "default").status.container_statuses[0]
    assert status.container_id.startswith("containerd://")
    pid = _task_pid(real.node, status.container_id.removeprefix("containerd://"))
    uid_line = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("Uid:"))
    assert uid_line.split()[1:] == ["10001"] * 4
    core.delete_namespaced_pod("sim", "default", grace_period_seconds=1)


def _if_ready(pod: Any) -> Any:
    return pod if is_ready(pod) else None


def _task_pid(node: RealNode, container_id: str) -> int:
    for line in node.ctr("tasks", "ls").stdout.splitlines()[1:]:
        task, pid, *_ = line.split()
        if task == container_id:
            return int(pid)
    raise AssertionError(f"no task {container_id} in containerd")


def test_the_chart_runs_on_the_real_node_and_a_sim_model_goes_0_1_0_through_its_gateway(
    real: Setup, core: client.CoreV1Api, tmp_path: Path
) -> None:
    """The chart with its default images: the tests' registry stands in for ghcr.io and docker.io."""
    helm = ensure_helm()
    reg = real.image.split("/", 1)[0]
    built = image.ensure_image()
    image.push(built.image, reg, "wakegate/wakegate", CHART_VERSION)
    image.push(built.envoy, reg, "envoyproxy/envoy", ENVOY_TAG)
    image.push(built.sim, reg, "wakegate/sim", "latest")
    image.push(image.ensure_llama_image(built.base), reg, "ggml-org/llama.cpp", "server")
    # The llama.cpp Model's weights: a tiny generated GGUF, mounted read-only from this machine.
    weights = tmp_path / "weights"
    weights.mkdir(mode=0o755)
    write_model(weights / "tiny.gguf").chmod(0o644)
    # Everything the chart schedules lands on the real node: the emulated node is cordoned, and the
    # real one carries a GPU label, as the node agent's DaemonSet asks for.
    for node in core.list_node().items:
        if node.metadata.name != real.node.name:
            core.patch_node(node.metadata.name, {"spec": {"unschedulable": True}})
    core.patch_node(real.node.name, {"metadata": {"labels": {"nvidia.com/gpu.present": "true"}}})
    core.create_namespace({"metadata": {"name": MODELS_NS}})
    started = time.monotonic()
    with real.cluster.api_client() as api:
        apps, custom = client.AppsV1Api(api), client.CustomObjectsApi(api)
        cache = {"agent": {"cache": {"hostPath": str(tmp_path / "node-cache")}}}
        held = {"drainSeconds": DRAIN_SECONDS, "nodeSelector": {"wakegate.io/e2e": "later"}}
        values = merged(BASE_VALUES, {"gateway": held, **cache})
        run_helm(helm, real.cluster, "install", RELEASE, str(CHART), "--namespace", NS, "--create-namespace",
                 "-f", values_file(tmp_path, "install.yaml", values))
        for component in COMPONENTS:
            pod = wait_for(functools.partial(ready_pod, core, component), 300, f"a ready {component} pod", every=1)
            assert pod.spec.node_name == real.node.name
            assert pod.status.container_statuses[0].container_id.startswith("containerd://")
        agent: Any = wait_for(lambda: next((p for p in pods(core, "agent") if p.spec.node_name == real.node.name
                                       and is_ready(p)), None), 120, "the agent Ready on the real node", every=1)
        installed_s = time.monotonic() - started
        addresses = {"xdsHost": ready_pod(core, "xds").status.pod_ip,
                     "scalerHost": ready_pod(core, "scaler").status.pod_ip}
        addressed = merged(BASE_VALUES, {"gateway": {"drainSeconds": DRAIN_SECONDS, **addresses}, **cache})
        run_helm(helm, real.cluster, "upgrade", RELEASE, str(CHART), "--namespace", NS,
                 "-f", values_file(tmp_path, "upgrade.yaml", addressed))
        gateway = wait_for(lambda: ready_pod(core, "gateway"), 240, "a ready gateway pod (envoy + extproc)", every=1)
        assert gateway.spec.node_name == real.node.name

        scaling = {"min": 0, "max": 1, "idleTimeout": 5, "activationTimeout": 240, "engine": "builtin"}
        models = _Models(custom, apps, core, real.node.name)

        def drain_a_stream() -> None:
            # The gateway pod deleted mid-stream: the kubelet runs the envoy container's preStop
            # (drain listeners, wait for requests in flight) before SIGTERM: the stream ends whole.
            stream = _stream_in_background(gateway.status.pod_ip)
            assert stream.first_chunk.wait(60), stream.error
            core.delete_namespaced_pod(gateway.metadata.name, NS)
            deleted = time.monotonic()
            stream.thread.join(120)
            assert stream.error is None, stream.error
            assert (stream.finish_reason, stream.tokens) == ("length", STREAM_TOKENS)
            assert stream.ended > deleted + 1, "the stream was still running when the pod's termination began"

        cold_s = models.zero_one_zero(gateway.status.pod_ip, "chat", {
            "backend": "sim", "args": ["--tokens-per-second", str(STREAM_TPS)], "scaling": scaling,
        }, while_up=drain_a_stream)

        # A llama.cpp Model: the llama-server image (pulled as ghcr.io/ggml-org/llama.cpp:server),
        # 0 -> 1 -> 0 through the gateway pod the Deployment made in place of the deleted one.
        gateway = wait_for(lambda: ready_pod(core, "gateway"), 240, "the replacement gateway pod Ready", every=1)
        llama_cold_s = models.zero_one_zero(gateway.status.pod_ip, "tiny", {
            "backend": "llamacpp", "source": f"file://{weights / 'tiny.gguf'}",
            "args": ["--threads", "1", "--ctx-size", "512"], "scaling": scaling,
        })
        print(f"\nreal node: chart components Ready {installed_s:.0f}s after install; cold request through "
              f"the gateway: sim {cold_s:.1f}s, llama.cpp {llama_cold_s:.1f}s (pod pulled, started, answered)")

        # The node agent's cache is a hostPath: the cache-owner init container handed it to uid 10001,
        # and what is in it outlives the agent's pod.
        host_cache = tmp_path / "node-cache"
        assert host_cache.stat().st_uid == 10001
        (host_cache / "kept").write_text("from before the restart")
        core.delete_namespaced_pod(agent.metadata.name, NS)
        wait_for(lambda: next((p for p in pods(core, "agent") if p.spec.node_name == real.node.name and is_ready(p)
                               and p.metadata.uid != agent.metadata.uid), None), 120, "a new agent pod Ready", every=1)
        assert (host_cache / "kept").read_text() == "from before the restart"


#: a stream of STREAM_TOKENS at STREAM_TPS lasts ~4 s, inside the gateway's drainSeconds (DRAIN_SECONDS)
STREAM_TOKENS, STREAM_TPS, DRAIN_SECONDS = 40, 10, 20


@dataclass
class Stream:
    thread: threading.Thread
    first_chunk: threading.Event
    tokens: int = 0
    finish_reason: str | None = None
    ended: float = 0.0
    error: str | None = None


def _stream_in_background(gateway_ip: str) -> Stream:
    stream = Stream(threading.Thread(), threading.Event())

    def run() -> None:
        try:
            with OpenAI(base_url=f"http://{gateway_ip}:8090/v1", api_key="unused", max_retries=0, timeout=120) as ai:
                chunks = ai.chat.completions.create(model="chat", messages=[{"role": "user", "content": "count"}],
                                                    max_tokens=STREAM_TOKENS, stream=True)
                for chunk in chunks:
                    if chunk.choices and chunk.choices[0].delta.content:
                        stream.tokens += 1
                        stream.first_chunk.set()
                    if chunk.choices and chunk.choices[0].finish_reason:
                        stream.finish_reason = chunk.choices[0].finish_reason
        except Exception as exc:
            stream.error = repr(exc)
        finally:
            stream.ended = time.monotonic()
            stream.first_chunk.set()

    stream.thread = threading.Thread(target=run, daemon=True)
    stream.thread.start()
    return stream


@dataclass
class _Models:
    custom: client.CustomObjectsApi
    apps: client.AppsV1Api
    core: client.CoreV1Api
    node: str

    def replicas(self, name: str) -> int:
        return int(self.apps.read_namespaced_deployment_scale(f"wg-{name}", MODELS_NS).spec.replicas or 0)

    def zero_one_zero(self, gateway_ip: str, name: str, spec: dict[str, Any],
                      while_up: Callable[[], None] = lambda: None) -> float:
        """Model `name` created at 0 replicas, its first request answered through the gateway (the
        seconds it took are returned) by a pod on the real node; `while_up` runs; back to 0."""
        self.custom.create_namespaced_custom_object(GROUP, VERSION, MODELS_NS, "models", {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "Model", "metadata": {"name": name}, "spec": spec})
        wait_for(lambda: _exists(self.apps, f"wg-{name}") and self.replicas(name) == 0, 120,
                 f"Model {name}'s Deployment at 0", every=1)
        cold = time.monotonic()
        status, body = chat(f"http://{gateway_ip}:8090", name)
        cold_s = time.monotonic() - cold
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] is not None
        (pod,) = [p for p in self.core.list_namespaced_pod(MODELS_NS).items
                  if is_ready(p) and p.metadata.name.startswith(f"wg-{name}-")]
        assert pod.spec.node_name == self.node
        while_up()
        wait_for(lambda: self.replicas(name) == 0, 120, f"Model {name} back at 0 after idleTimeout", every=1)
        return cold_s


def _exists(apps: client.AppsV1Api, name: str) -> bool:
    try:
        apps.read_namespaced_deployment(name, MODELS_NS)
    except client.ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


def test_the_node_leaves_this_machines_iptables_alone(real: Setup) -> None:
    """The node's network lives in its namespace: with its kubelet, containerd and pods running
    (this runs after the chart's test), this machine's own rules are the ones it had before."""
    with real.cluster.api_client() as api:
        node = client.CoreV1Api(api).read_node(real.node.name)
    assert any(c.type == "Ready" and c.status == "True" for c in node.status.conditions), node.status.conditions
    assert host_rules() == real.host_rules
