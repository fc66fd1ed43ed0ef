"""Model delivery on the real control plane: ModelCache prewarm into node caches, `cache: prewarm`
Models served from them, the scheduler extender preferring warm nodes, and a bad reference.

One cluster of its own (the scheduler calls `wakegate scheduler-extender`) with two NVIDIA nodes,
`pw-warm` and `pw-cold`. Each runs a real `wakegate agent` (fake GPU discovery) with its own
node cache directory and a service-account token holding exactly the chart's agent rules; the
operator runs with exactly its chart rules too. Weights come from real CNCF Distribution
registries on loopback (one anonymous, one with htpasswd auth), pushed with `wakegate cache
push`; the model is a generated GGUF served by the real llama-server that e2e/engines.py built.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.cluster import REPO_ROOT, Cluster
from e2e.gateway import (
    AGENT_RULES,
    LEASE_RULES,
    OPERATOR_RULES,
    Gateway,
    Operator,
    install_crds,
    python_env,
    scoped_kubeconfig,
)
from e2e.helpers import Kube, fresh_namespace, has_default_sa, http_ok, is_ready
from e2e.procs import Proc
from e2e.tinymodel import ModelSpec, write_model
from e2e.tools.registry import Registry, start_registry
from tests.support.required import missing
from tests.support.waiting import wait_for
from wakegate.control.admin import free_port
from wakegate.control.k8s import names

pytestmark = pytest.mark.e2e

GROUP, VERSION = names.GROUP, names.VERSION
SYSTEM = "wakegate-system"
WARM, COLD = "pw-warm", "pw-cold"
NODES: list[dict[str, Any]] = [
    {"name": WARM, "labels": {"pool": "warm"}, "capacity": {"nvidia.com/gpu": "4"}},
    {"name": COLD, "labels": {"pool": "cold"}, "capacity": {"nvidia.com/gpu": "4"}},
]


def _gpus(free: int) -> list[dict[str, Any]]:
    return [{"vendor": "nvidia", "arch": "sm90", "name": "H100", "total_mb": 81559, "free_mb": free,
             "utilization": 10}]


#: The cold node has more free VRAM: on every other score term it is the better node.
FAKE_GPUS = {WARM: _gpus(20000), COLD: _gpus(80000)}
LLAMA_SERVER = REPO_ROOT / "e2e" / ".bin" / "llama-server"


@dataclass
class Prewarm:
    cluster: Cluster
    registry: Registry
    secure: Registry
    extender_url: str
    caches: dict[str, Path]
    procs: list[Proc]
    work: Path

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.tail(30)}" for p in self.procs)


def _push(registry: Registry, work: Path, ref: str, seed: int) -> str:
    """A generated GGUF pushed with `wakegate cache push`; returns the oci:// source."""
    gguf = write_model(work / f"tiny-{seed}.gguf", ModelSpec(seed=seed))
    env = python_env()
    config = work / f"docker-{registry.host.replace(':', '-')}"
    config.mkdir(mode=0o700, exist_ok=True)
    (config / "config.json").write_bytes(registry.docker_config.read_bytes())
    env["DOCKER_CONFIG"] = str(config)  # the file Docker reads: the password is in no argument
    source = f"oci://{registry.host}/{ref}"
    subprocess.run([sys.executable, "-m", "wakegate", "cache", "push", str(gguf), source], env=env, check=True,
                   capture_output=True, text=True, timeout=120)
    return source


@pytest.fixture(scope="module")
def prewarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prewarm]:
    work = tmp_path_factory.mktemp("prewarm")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = work / "scheduler.yaml"
    config.write_text((REPO_ROOT / "e2e" / "scheduler" / "extender.yaml").read_text().replace("{extender_url}", url))
    spec = work / "nodes.yaml"
    spec.write_text(yaml.safe_dump(NODES))
    gpus = work / "gpus.json"
    gpus.write_text(json.dumps(FAKE_GPUS))
    caches = {node["name"]: work / f"cache-{node['name']}" for node in NODES}
    procs: list[Proc] = []
    with (start_registry(work / "registry") as registry,
          start_registry(work / "secure", auth=True) as secure):
        cluster = Cluster(work / "cluster", nodes=len(NODES), node_spec=spec, scheduler_config=config)
        cluster.start()
        try:
            with cluster.api_client() as api:
                install_crds(api)
                core = client.CoreV1Api(api)
                core.create_namespace({"metadata": {"name": SYSTEM}})
                wait_for(lambda: has_default_sa(core, SYSTEM), 30, "default service account")
                system = Kube(api, SYSTEM, cluster)
                with (scoped_kubeconfig(system, work, "operator", OPERATOR_RULES, LEASE_RULES) as operator_config,
                      scoped_kubeconfig(system, work, "agent", AGENT_RULES) as agent_config):
                    procs.append(Proc("extender", [
                        sys.executable, "-m", "wakegate", "scheduler-extender", "--listen", f"127.0.0.1:{port}",
                        "--kubeconfig", str(cluster.kubeconfig), "--bench-namespace", SYSTEM,
                    ], work / "extender.log", env=python_env()))
                    for node in NODES:
                        name = node["name"]
                        procs.append(Proc(f"agent-{name}", [
                            sys.executable, "-m", "wakegate", "agent", "--node-name", name,
                            "--kubeconfig", str(agent_config), "--fake-gpus", str(gpus), "--interval", "1",
                            "--cache-dir", str(caches[name]), "--retry-seconds", "5",
                        ], work / f"agent-{name}.log", env=python_env()))
                    operator = Operator(work, operator_config, SYSTEM, "operator",
                                        ["--renew-seconds", "1", "--node-cache-dir", str(caches[WARM])])
                    procs.append(operator.proc)
                    try:
                        for proc in procs:
                            proc.start()
                        wait_for(lambda: http_ok(f"{url}/readyz"), 30, "extender caches synced")
                        yield Prewarm(cluster, registry, secure, url, caches, procs, work)
                    finally:  # before the tokens' roles go
                        for proc in procs:
                            proc.stop(5.0)
        finally:
            cluster.stop()


@pytest.fixture
def pkube(prewarm: Prewarm) -> Iterator[Kube]:
    with fresh_namespace(prewarm.cluster) as kube:
        yield kube


def create(kube: Kube, plural: str, name: str, spec: dict[str, Any]) -> None:
    kind = {"models": "Model", "modelcaches": "ModelCache"}[plural]
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": kind, "metadata": {"name": name}, "spec": spec}
    kube.custom.create_namespaced_custom_object(GROUP, VERSION, kube.ns, plural, body)


def get(kube: Kube, plural: str, name: str) -> dict[str, Any]:
    try:
        body: dict[str, Any] = kube.custom.get_namespaced_custom_object(GROUP, VERSION, kube.ns, plural, name)
    except ApiException as exc:
        if exc.status == 404:
            return {}
        raise
    return body


def entries(kube: Kube, cache: str) -> dict[str, dict[str, Any]]:
    """node -> its status entry (one source per ModelCache here)."""
    return {e["node"]: e for e in (get(kube, "modelcaches", cache).get("status") or {}).get("nodes") or []}


def condition(kube: Kube, model: str, type_: str) -> dict[str, Any]:
    for cond in (get(kube, "models", model).get("status") or {}).get("conditions") or []:
        if cond["type"] == type_:
            return dict(cond)
    return {}


def node_labels(kube: Kube, node: str) -> dict[str, str]:
    return dict(kube.core.read_node(node).metadata.labels or {})


def kubectl_get(kube: Kube, what: str) -> list[list[str]]:
    out = subprocess.run(["kubectl", "--kubeconfig", str(kube.cluster.kubeconfig), "-n", kube.ns, "get", what],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return [line.split() for line in out.strip().splitlines()]


def llama_model(source: str, **extra: Any) -> dict[str, Any]:
    return {
        "backend": "llamacpp",
        "source": source,
        "cache": {"strategy": "prewarm"},
        "args": ["--threads", "1", "--ctx-size", "512"],
        "resources": {"gpu": {"count": 1, "vendor": "nvidia"}},
        "scaling": {"min": 1, "max": 1, "engine": "builtin"},
        **extra,
    }


def test_modelcache_prewarms_the_node_and_the_model_serves_from_it(prewarm: Prewarm, pkube: Kube) -> None:
    if not LLAMA_SERVER.exists():
        missing(f"{LLAMA_SERVER} is not built (python -m e2e.engines llama-server)")
    source = _push(prewarm.registry, prewarm.work, "models/tiny:v1", seed=1)
    create(pkube, "models", "tiny", llama_model(source, nodeSelector={"pool": "warm"}))
    cache = names.owned_cache_name("tiny")
    # The operator keeps a ModelCache for the Model (none names it); the warm node's agent pulls.
    def ready_on_warm() -> dict[str, dict[str, Any]] | None:
        found = entries(pkube, cache)
        return found if (found.get(WARM) or {}).get("phase") == "Ready" else None

    ready = wait_for(ready_on_warm, 60, f"{cache} Ready on {WARM}\n{prewarm.logs()}")

    assert ready is not None
    warm = ready[WARM]
    assert set(ready) == {WARM}, "the Model may run only on the warm pool: the cold node wants nothing"
    assert warm["digest"].startswith("sha256:") and warm["file"] == "tiny-1.gguf" and warm["size"] > 0
    digest = warm["digest"]
    assert (prewarm.caches[WARM] / "entries" / digest.replace(":", "-") / "files" / "tiny-1.gguf").is_file()
    assert not (prewarm.caches[COLD] / "entries").exists() or not any((prewarm.caches[COLD] / "entries").iterdir())
    wait_for(lambda: (get(pkube, "modelcaches", cache).get("status") or {}).get("ready") == "1/1", 30, "1/1 ready")
    header, *rows = kubectl_get(pkube, "modelcaches")
    assert header == ["NAME", "SOURCE", "READY", "REASON", "AGE"]
    # The operator pinned the tag to the digest it named (status.pinnedSource), and its ModelCache
    # names that digest: a tag moved later changes nothing here.
    assert get(pkube, "models", "tiny")["status"]["pinnedSource"] == f"{source}@{digest}"
    assert rows[0][:4] == [cache, f"{source}@{digest}", "1/1", "Ready"]
    wait_for(lambda: names.cache_label(digest) in node_labels(pkube, WARM), 30, "the warm node's cache label")
    assert not any(k.startswith(names.NODE_CACHE_PREFIX) for k in node_labels(pkube, COLD))

    # The pod exists only now, mounts the entry read-only, and runs on the node that holds it.
    def ready_pod() -> Any:
        pods = [p for p in pkube.pods(f"{names.LABEL_MODEL}=tiny") if is_ready(p)]
        return pods[0] if pods else None

    pod = wait_for(ready_pod, 90, f"the backend pod Ready\n{prewarm.logs()}")
    assert pod.spec.node_name == WARM
    assert pod.metadata.annotations[names.ANNOTATION_WEIGHTS] == digest
    (volume,) = pod.spec.volumes[:1]
    assert volume.host_path.path == f"{prewarm.caches[WARM]}/entries/{digest.replace(':', '-')}"
    assert "/models/cache/files/tiny-1.gguf" in pod.spec.containers[0].args
    assert condition(pkube, "tiny", "WeightsPulling")["reason"] == "WeightsReady"
    assert condition(pkube, "tiny", "PrewarmFailed")["status"] == "False"
    wait_for(lambda: get(pkube, "models", "tiny").get("status", {}).get("phase") == "Ready", 30, "Model Ready")

    gateway = Gateway(prewarm.work / f"gw-{pkube.ns}", prewarm.cluster.kubeconfig)
    (prewarm.work / f"gw-{pkube.ns}").mkdir(exist_ok=True)
    gateway.start()
    try:
        def answer() -> dict[str, Any] | None:
            status, reply = gateway.chat("tiny", timeout=60)
            return reply if status == 200 else None

        body = wait_for(answer, 60, f"an answer through the gateway\n{prewarm.logs()}")

        assert body is not None
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] > 0
    finally:
        gateway.stop()


def test_the_extender_prefers_the_node_holding_the_weights(prewarm: Prewarm, pkube: Kube) -> None:
    source = _push(prewarm.registry, prewarm.work, "models/tiny:v1", seed=1)
    create(pkube, "modelcaches", "warm-pool", {"sources": [source], "nodeSelector": {"pool": "warm"}})
    ready = wait_for(lambda: (entries(pkube, "warm-pool").get(WARM) or {}).get("digest"), 60,
                     f"warm-pool Ready on {WARM}\n{prewarm.logs()}")
    digest = str(ready)
    wait_for(lambda: names.cache_label(digest) in node_labels(pkube, WARM), 30, "the warm node's cache label")

    def gpu_pod(name: str, weights: str | None) -> dict[str, Any]:
        annotations = {names.ANNOTATION_BACKEND: "llamacpp", **({names.ANNOTATION_WEIGHTS: weights} if weights else {})}
        return {
            "metadata": {"name": name, "annotations": annotations},
            "spec": {"terminationGracePeriodSeconds": 1, "containers": [{
                "name": "main", "image": "wakegate/e2e-exec:dev",
                "command": ["python", "-c", "import time; time.sleep(600)"],
                "resources": {"limits": {"nvidia.com/gpu": "1"}},
            }]},
        }

    # Without weights to read, the free VRAM decides: the cold node. With them, the warm one.
    pkube.core.create_namespaced_pod(pkube.ns, gpu_pod("plain", None))
    assert wait_for(lambda: pkube.pod("plain").spec.node_name, 30, "plain bound") == COLD
    pkube.core.create_namespaced_pod(pkube.ns, gpu_pod("reads-weights", digest))
    assert wait_for(lambda: pkube.pod("reads-weights").spec.node_name, 30, "reads-weights bound") == WARM
    log = (prewarm.work / "extender.log").read_text()
    assert f"score {pkube.ns}/reads-weights" in log


def test_cache_node_runs_where_a_modelcache_of_yours_has_the_weights(prewarm: Prewarm, pkube: Kube) -> None:
    if not LLAMA_SERVER.exists():
        missing(f"{LLAMA_SERVER} is not built (python -m e2e.engines llama-server)")
    source = _push(prewarm.registry, prewarm.work, "models/tiny:v1", seed=1)
    create(pkube, "modelcaches", "warm-pool", {"sources": [source], "nodeSelector": {"pool": "warm"}})
    create(pkube, "models", "nodal", {**llama_model(source), "cache": {"strategy": "node"}})

    def ready_pod() -> Any:
        pods = [p for p in pkube.pods(f"{names.LABEL_MODEL}=nodal") if is_ready(p)]
        return pods[0] if pods else None

    pod = wait_for(ready_pod, 90, f"the backend pod Ready\n{prewarm.logs()}")
    assert pod.spec.node_name == WARM, "no node selector on the Model: the weights decide"
    assert get(pkube, "modelcaches", names.owned_cache_name("nodal")) == {}, "yours covers it: none of ours"
    assert condition(pkube, "nodal", "WeightsPulling")["reason"] == "WeightsReady"


def test_a_bad_reference_is_prewarm_failed_with_the_reason(prewarm: Prewarm, pkube: Kube) -> None:
    _push(prewarm.registry, prewarm.work, "models/tiny:v1", seed=1)
    # A tag the registry does not have: the operator cannot pin it, so nothing is rendered from it.
    create(pkube, "models", "no-tag", llama_model(f"oci://{prewarm.registry.host}/models/tiny:nope"))

    def unresolved() -> dict[str, Any] | None:
        found = condition(pkube, "no-tag", "Ready")
        return found if found.get("reason") == "not_found" else None

    no_tag = wait_for(unresolved, 30, f"Ready=False not_found on no-tag\n{prewarm.logs()}")
    assert no_tag is not None and "nope" in no_tag["message"]
    assert get(pkube, "modelcaches", names.owned_cache_name("no-tag")) == {}, "nothing to pull before the pin"
    # A digest no node can pull: each node's agent says why, and the Model waits for none of them.
    nope = "sha256:" + "0" * 64
    source = f"oci://{prewarm.registry.host}/models/tiny@{nope}"
    create(pkube, "models", "broken", llama_model(source))
    cache = names.owned_cache_name("broken")
    def failed_on_both() -> dict[str, dict[str, Any]] | None:
        found = entries(pkube, cache)
        return found if len(found) == 2 and all(e["phase"] == "Failed" for e in found.values()) else None

    failed = wait_for(failed_on_both, 60, f"{cache} Failed on both nodes\n{prewarm.logs()}")

    assert failed is not None
    assert {e["reason"] for e in failed.values()} == {"not_found"}
    assert nope[:19] in failed[WARM]["message"]
    def model_failed() -> dict[str, Any] | None:
        found = condition(pkube, "broken", "PrewarmFailed")
        return found if found.get("status") == "True" else None

    prewarm_failed = wait_for(model_failed, 30, "PrewarmFailed on the Model")

    assert prewarm_failed is not None
    assert prewarm_failed["reason"] == "not_found" and nope[:19] in prewarm_failed["message"]
    # Failed once the operator saw every node's entry fail (the condition may come a reconcile earlier).
    def phase_failed() -> dict[str, Any] | None:
        found: dict[str, Any] = get(pkube, "models", "broken").get("status") or {}
        return found if found.get("phase") == "Failed" else None

    status = wait_for(phase_failed, 30, "phase Failed")
    assert status is not None
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "PrewarmFailed"
    with pytest.raises(ApiException) as missing:
        pkube.apps.read_namespaced_deployment(names.backend_name("broken"), pkube.ns)
    assert missing.value.status == 404, "no Deployment, so no pod claims a GPU for weights that never come"
    _, *rows = kubectl_get(pkube, "modelcaches")
    assert [row[2:4] for row in rows if row[0] == cache] == [["0/2", "not_found"]]
    # A source the API server lets through (its pattern is coarse) but no node cache holds.
    create(pkube, "modelcaches", "in-place", {"sources": ["file:///models/tiny.gguf"]})

    def invalid() -> str | None:
        conds = (get(pkube, "modelcaches", "in-place").get("status") or {}).get("conditions") or []
        return next((c["message"] for c in conds if c["reason"] == "InvalidSpec"), None)

    assert "a node cache holds oci:// and hf:// sources" in str(wait_for(invalid, 30, "InvalidSpec on in-place"))
    assert not entries(pkube, "in-place"), "no agent acts on it"


def test_registry_credentials_come_from_the_secret_and_stay_secret(prewarm: Prewarm, pkube: Kube) -> None:
    source = _push(prewarm.secure, prewarm.work, "models/private:v1", seed=7)
    assert prewarm.secure.credentials is not None
    secret = base64.b64encode(prewarm.secure.docker_config.read_bytes()).decode()
    pkube.core.create_namespaced_secret(pkube.ns, {
        "metadata": {"name": "regcred"}, "type": "kubernetes.io/dockerconfigjson",
        "data": {".dockerconfigjson": secret},
    })
    create(pkube, "modelcaches", "private", {"sources": [source], "nodeSelector": {"pool": "cold"},
                                             "credentials": {"name": "regcred"}})
    # On the other node: a node's cache serves whoever wants an entry it holds (as a kubelet's
    # images do with IfNotPresent), so the refusal is only visible where nothing is cached yet.
    create(pkube, "modelcaches", "anonymous", {"sources": [source], "nodeSelector": {"pool": "warm"}})
    ready = wait_for(lambda: (entries(pkube, "private").get(COLD) or {}).get("phase") == "Ready", 60,
                     f"private Ready on {COLD}\n{prewarm.logs()}")
    assert ready
    def anonymous_refused() -> dict[str, Any] | None:
        found = entries(pkube, "anonymous").get(WARM) or {}
        return found if found.get("phase") == "Failed" else None

    refused = wait_for(anonymous_refused, 60, "anonymous refused")

    assert refused is not None
    assert refused["reason"] == "unauthorized"
    password = prewarm.secure.credentials.password
    shown = json.dumps([get(pkube, "modelcaches", n) for n in ("private", "anonymous")])
    assert password not in shown
    for proc in prewarm.procs:
        assert password not in proc.tail(10_000), f"{proc.name}'s log holds the registry password"
        assert not any(password in a for a in proc.argv)
