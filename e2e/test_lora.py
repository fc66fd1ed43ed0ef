"""LoRAAdapters on the real control plane, served through the gateway the chart runs.

- llama.cpp: a Model of the generated base GGUF and two LoRAAdapters (generated LoRA GGUFs on the
  node, file://). The operator starts the base's pod with `--lora-init-without-apply --lora FILE`
  for both; the feeder routes the adapters' names (body `model`, X-Model-ID, /model/NAME/, an
  alias) to the base with their `--lora` id. Interleaved requests for A and B are each answered
  with that adapter applied: the greedy completion is the one a llama-server of our own gives for
  that adapter, differs from the base's and the other adapter's, and is the same every time.
  `kubectl get loraadapters` shows base, loaded replicas, Ready; an adapter of a Model that does
  not exist says so; removing an adapter rolls the base's pod without it.
- A base at zero: the first request for its adapter wakes it once (`wakegate scaler`, builtin
  engine) and is answered with the adapter applied.
- vLLM (the simulator with `--enable-lora`): the operator loads the adapters into the pod through
  `POST /v1/load_lora_adapter`, at most `maxAdapters`, before the pod's readiness gate lets it be
  routed; the next one is refused with the reason; an adapter request through the gateway reaches
  the engine by the adapter's name, also the first one, which wakes a base at zero.
- Real vLLM (the CPU install e2e/engines.py keeps) from a generated Hugging Face folder, with a
  PEFT adapter folder on the node: the adapter's first request wakes the base, the operator loads
  the adapter by its path in the pod (the harness binds hostPath volumes for vLLM, which is told
  paths while it runs) before the readiness gate opens, and the adapter's answers are its own.

The operator and the feeder run with service-account tokens holding exactly the chart's rules
(`OPERATOR_RULES`, `XDS_RULES`), so what they do here is what the chart lets them do.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from e2e.cluster import REPO_ROOT
from e2e.gateway import (
    LEASE_RULES,
    OPERATOR_RULES,
    XDS_RULES,
    Gateway,
    Operator,
    install_crds,
    post_json,
    python_env,
    scoped_kubeconfig,
)
from e2e.helpers import Kube, is_ready
from e2e.procs import Proc
from e2e.tinymodel import ModelSpec, write_lora, write_model
from tests.support.required import missing
from tests.support.waiting import wait_for
from wakegate.control.admin import free_port
from wakegate.control.k8s import names
from wakegate.control.k8s.adapters import GATE_ADAPTERS

pytestmark = pytest.mark.e2e

GROUP, VERSION = names.GROUP, names.VERSION
LLAMA_SERVER = REPO_ROOT / "e2e" / ".bin" / "llama-server"
PROMPT = [{"role": "user", "content": "tell me about the weather"}]
MAX_TOKENS = 12


@dataclass
class Served:
    kube: Kube
    gateway: Gateway
    operator: Operator
    scaler: Proc

    def logs(self) -> str:
        procs = [self.operator.proc, *self.gateway.procs, self.scaler]
        return "\n".join(f"--- {p.name}\n{p.tail(20)}" for p in procs)


@pytest.fixture
def served(kube: Kube, tmp_path: Path) -> Iterator[Served]:
    """The operator and the gateway (feeder + extproc + Envoy), each with the chart's rules, and the
    builtin scaler the gateway reports demand to."""
    install_crds(kube.api)
    with (scoped_kubeconfig(kube, tmp_path, "operator", OPERATOR_RULES, LEASE_RULES) as operator_config,
          scoped_kubeconfig(kube, tmp_path, "xds", XDS_RULES) as xds_config):
        operator = Operator(tmp_path, operator_config, kube.ns, "operator", ["--renew-seconds", "1"])
        demand = free_port()
        gateway = Gateway(tmp_path, xds_config, demand=f"127.0.0.1:{demand}")
        scaler = Proc("scaler", [
            sys.executable, "-m", "wakegate", "scaler", "--kubeconfig", str(kube.cluster.kubeconfig),
            "--demand-listen", f"127.0.0.1:{demand}", "--keda-listen", f"127.0.0.1:{free_port()}",
            "--admin-listen", f"127.0.0.1:{free_port()}", "--lease-namespace", kube.ns,
            "--internal-token-file", str(gateway.token),
        ], tmp_path / "scaler.log", env=python_env())
        operator.start()
        scaler.start()
        try:
            gateway.start()
            try:
                yield Served(kube, gateway, operator, scaler)
            finally:
                gateway.stop()
        finally:
            scaler.stop()
            operator.stop()
    # An RBAC refusal names the account ("forbidden: User ..."; Kopf: "Not enough permissions"); a
    # write into another test's namespace while it is being terminated is refused without one.
    for proc in (operator.proc, gateway.xds):
        log = proc.tail(400)
        assert "forbidden: User" not in log and "Not enough permissions" not in log, f"{proc.name}: {log[-3000:]}"


def create(kube: Kube, plural: str, name: str, spec: dict[str, Any]) -> None:
    kind = {"models": "Model", "loraadapters": "LoRAAdapter"}[plural]
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": kind, "metadata": {"name": name}, "spec": spec}
    kube.custom.create_namespaced_custom_object(GROUP, VERSION, kube.ns, plural, body)


def status(kube: Kube, plural: str, name: str) -> dict[str, Any]:
    try:
        body = kube.custom.get_namespaced_custom_object(GROUP, VERSION, kube.ns, plural, name)
    except ApiException as exc:
        if exc.status == 404:
            return {}
        raise
    return dict(body.get("status") or {})


def kubectl_get(kube: Kube, what: str) -> dict[str, list[str]]:
    """`kubectl get WHAT` as rows by name, the header under "NAME"."""
    out = subprocess.run(["kubectl", "--kubeconfig", str(kube.cluster.kubeconfig), "-n", kube.ns, "get", what],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    rows = [line.split() for line in out.strip().splitlines()]
    return {row[0]: row[1:] for row in rows}


def ask(url: str, model: str, how: str = "body", timeout: float = 60, **extra: Any) -> tuple[int, dict[str, Any]]:
    """A greedy chat completion of PROMPT naming `model` in the body, in X-Model-ID or in the path."""
    headers: dict[str, str] = {}
    target, named = f"{url}/v1/chat/completions", model
    if how == "header":
        headers["X-Model-ID"], named = model, "ignored-by-the-gateway"
    elif how == "path":
        target, named = f"{url}/model/{model}/v1/chat/completions", "also-ignored"
    body = {"model": named, "messages": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "seed": 7, **extra}
    return post_json(target, body, headers, timeout)


def text(reply: tuple[int, dict[str, Any]]) -> str:
    code, body = reply
    assert code == 200, body
    return str(body["choices"][0]["message"]["content"] or "")


def expected_answers(base: Path, *loras: Path) -> dict[str, str]:
    """What a llama-server of our own answers for the base and for each adapter (by its file's
    stem; asked by its id here)."""
    port = free_port()
    argv = [str(LLAMA_SERVER), "--model", str(base), "--host", "127.0.0.1", "--port", str(port), "--threads", "1",
            "--ctx-size", "512"]
    for lora in loras:
        argv += ["--lora", str(lora)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _status(f"{url}/health") == 200, 30, "the reference llama-server healthy")
        off = [{"id": i, "scale": 0.0} for i in range(len(loras))]
        answers = {"base": text(ask(url, "tiny", lora=off))}
        for i, lora in enumerate(loras):
            answers[lora.stem] = text(ask(url, "tiny", lora=[{"id": i, "scale": 1.0}]))
        return answers
    finally:
        proc.terminate()
        proc.wait(10)


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return err.code
    except (urllib.error.URLError, OSError):
        return 0


def settled(served: Served, model: str) -> None:
    """Wait until a new `min: 0` Model is Idle, its Deployment created and handed to the scaler.

    A scale-up landing within the operator's first apply of a Deployment (create, then the
    replicas handoff to the scaler's field manager) can be overwritten by the handoff; these
    tests are about adapters, so they wake a base that has settled.
    """
    wait_for(lambda: status(served.kube, "models", model).get("phase") == "Idle", 60,
             f"Model {model} Idle\n{served.logs()}")

    def handed_over() -> bool:
        try:
            deployment = served.kube.apps.read_namespaced_deployment(names.backend_name(model), served.kube.ns)
        except ApiException:
            return False
        owners = {e.manager for e in deployment.metadata.managed_fields or []
                  if "f:replicas" in ((e.fields_v1 or {}).get("f:spec") or {})}
        return owners == {names.SCALER_FIELD_MANAGER}

    wait_for(handed_over, 30, f"the replicas of {model} handed to the scaler\n{served.logs()}")


def _ready_pods(kube: Kube, model: str) -> list[Any]:
    return [p for p in kube.pods(f"{names.LABEL_MODEL}={model}") if is_ready(p) and not p.metadata.deletion_timestamp]


def test_two_adapters_of_a_llama_cpp_base_each_answer_with_their_own_weights(served: Served, tmp_path: Path) -> None:
    if not LLAMA_SERVER.exists():
        missing(f"{LLAMA_SERVER} is not built (python -m e2e.engines llama-server)")
    kube, gateway = served.kube, served.gateway
    weights = tmp_path / "weights"
    weights.mkdir()
    base = write_model(weights / "tiny.gguf", ModelSpec(seed=0))
    sql = write_lora(weights / "sql.gguf", ModelSpec(seed=0), seed=11)
    poet = write_lora(weights / "poet.gguf", ModelSpec(seed=0), seed=12)
    expected = expected_answers(base, sql, poet)
    # The adapter changes the logits: each greedy completion is its own.
    assert len(set(expected.values())) == 3, expected

    # Adapters first: until their base exists they say so, and one whose base never comes keeps saying it.
    create(kube, "loraadapters", "sql", {"baseModel": "tiny", "source": f"file://{sql}", "servedName": "tiny-sql",
                                         "aliases": ["sql-v1"]})
    create(kube, "loraadapters", "poet", {"baseModel": "tiny", "source": f"file://{poet}"})
    create(kube, "loraadapters", "orphan", {"baseModel": "nothing", "source": f"file://{poet}"})
    wait_for(lambda: status(kube, "loraadapters", "sql").get("reason") == "BaseModelNotFound", 30,
             f"sql waiting for its base\n{served.logs()}")
    started = time.monotonic()
    create(kube, "models", "tiny", {
        "backend": "llamacpp", "servedName": "org/tiny", "source": f"file://{base}",
        "args": ["--threads", "1", "--ctx-size", "512"], "scaling": {"min": 1, "max": 1, "engine": "builtin"},
    })

    def both_loaded() -> bool:
        return all(status(kube, "loraadapters", n).get("ready") == "True" for n in ("sql", "poet"))

    wait_for(both_loaded, 120, f"both adapters loaded\n{served.logs()}", every=0.5)
    print(f"lora e2e: Model created -> both adapters Ready: {time.monotonic() - started:.1f} s")
    (pod,) = _ready_pods(kube, "tiny")
    args = pod.spec.containers[0].args
    assert "--lora-init-without-apply" in args and args.count("--lora") == 2
    assert set(pod.metadata.annotations["wakegate.io/lora-adapters"].split(",")) == {"sql", "poet"}
    for name in ("sql", "poet"):
        got = status(kube, "loraadapters", name)
        assert (got["loadedReplicas"], got["replicas"], got["reason"]) == (1, [pod.metadata.name], "Loaded")
        assert got["lastLoadTime"] and got["loads"] == 1
    orphan = status(kube, "loraadapters", "orphan")
    assert (orphan["ready"], orphan["reason"]) == ("False", "BaseModelNotFound")
    assert "nothing" in orphan["message"]
    rows = kubectl_get(kube, "loraadapters")
    assert rows["NAME"][:4] == ["BASE", "LOADED", "READY", "REASON"]
    assert rows["sql"][:4] == ["tiny", "1", "True", "Loaded"] and rows["poet"][:4] == ["tiny", "1", "True", "Loaded"]
    assert rows["orphan"][:4] == ["nothing", "0", "False", "BaseModelNotFound"]

    url = gateway.url
    wait_for(lambda: ask(url, "tiny-sql")[0] == 200, 60, f"the adapter routed\n{served.logs()}")
    # Interleaved, by every way a request names a model: each gets its adapter, the base none.
    for name, how, want in [
        ("sql", "body", "sql"), ("poet", "body", "poet"), ("tiny-sql", "header", "sql"), ("poet", "path", "poet"),
        ("org/tiny", "body", "base"), ("sql-v1", "path", "sql"), ("poet", "header", "poet"), ("tiny", "body", "base"),
        ("sql", "body", "sql"), ("poet", "body", "poet"),
    ]:
        assert text(ask(url, name, how)) == expected[want], (name, how)
    code, body = ask(url, "orphan")
    assert code == 404 and body["error"]["code"] == "model_not_found", body
    served_names = {m["id"] for m in json.loads(urllib.request.urlopen(f"{url}/v1/models", timeout=10).read())["data"]}
    assert {"tiny-sql", "sql-v1", "poet", "org/tiny"} <= served_names and "orphan" not in served_names

    # llama.cpp loads adapters only at start: removing one rolls the base's pod without it.
    removed = time.monotonic()
    kube.custom.delete_namespaced_custom_object(GROUP, VERSION, kube.ns, "loraadapters", "poet")

    def rolled() -> Any:
        pods = _ready_pods(kube, "tiny")
        fresh = [p for p in pods if p.metadata.annotations.get("wakegate.io/lora-adapters") == "sql"]
        return fresh[0] if len(pods) == 1 and fresh else None

    new = wait_for(rolled, 120, f"the base rolled without poet\n{served.logs()}", every=0.5)
    print(f"lora e2e: LoRAAdapter deleted -> the base's pod rolled without it: {time.monotonic() - removed:.1f} s")
    assert new.spec.containers[0].args.count("--lora") == 1
    wait_for(lambda: status(kube, "loraadapters", "sql").get("replicas") == [new.metadata.name], 30,
             "sql held by the new pod")
    wait_for(lambda: ask(url, "poet")[0] == 404, 30, "poet no longer routed")
    assert text(ask(url, "sql")) == expected["sql"]
    assert status(kube, "loraadapters", "sql")["loads"] == 2


def test_an_adapter_request_wakes_its_base_from_zero_once(served: Served, tmp_path: Path) -> None:
    if not LLAMA_SERVER.exists():
        missing(f"{LLAMA_SERVER} is not built (python -m e2e.engines llama-server)")
    kube = served.kube
    weights = tmp_path / "weights"
    weights.mkdir()
    base = write_model(weights / "tiny.gguf", ModelSpec(seed=0))
    lora = write_lora(weights / "wake.gguf", ModelSpec(seed=0), seed=11)
    expected = expected_answers(base, lora)
    assert expected["wake"] != expected["base"]
    # Names of their own: the gateway is cluster-wide and the last test's namespace may still be going.
    create(kube, "loraadapters", "wake", {"baseModel": "sleeper", "source": f"file://{lora}"})
    create(kube, "models", "sleeper", {
        "backend": "llamacpp", "source": f"file://{base}", "args": ["--threads", "1", "--ctx-size", "512"],
        "scaling": {"min": 0, "max": 1, "engine": "builtin", "idleTimeout": 300, "activationTimeout": 120},
    })
    wait_for(lambda: status(kube, "loraadapters", "wake").get("reason") == "BaseNotReady", 60,
             f"wake waiting for a replica of its sleeping base\n{served.logs()}")
    settled(served, "sleeper")
    assert kube.pods(f"{names.LABEL_MODEL}=sleeper") == []
    wait_for(lambda: ask(served.gateway.url, "nothing-here")[0] == 404, 30, "the gateway routing")

    woken = time.monotonic()
    assert text(ask(served.gateway.url, "wake", timeout=150)) == expected["wake"]
    print(f"lora e2e: adapter request for a base at zero answered in {time.monotonic() - woken:.1f} s")
    (pod,) = kube.pods(f"{names.LABEL_MODEL}=sleeper")
    assert pod.spec.containers[0].args.count("--lora") == 1
    assert served.scaler.tail(400).count(f"scaled {kube.ns}/sleeper to 1 replicas") == 1, served.scaler.tail(40)
    wait_for(lambda: status(kube, "loraadapters", "wake").get("reason") == "Loaded", 30, "wake Loaded")
    assert text(ask(served.gateway.url, "wake")) == expected["wake"]
    assert text(ask(served.gateway.url, "sleeper")) == expected["base"]


def test_the_operator_loads_vllm_adapters_into_ready_pods_up_to_max_adapters(served: Served) -> None:
    kube, gateway = served.kube, served.gateway
    create(kube, "models", "chat", {
        "backend": "sim", "adapters": {"maxAdapters": 2},
        "scaling": {"min": 1, "max": 1, "engine": "builtin"},
    })
    # The maxAdapters cut follows creation, then the name: alpha and beta are served, gamma is not.
    started = time.monotonic()
    for name in ("alpha", "beta", "gamma"):
        create(kube, "loraadapters", name, {"baseModel": "chat", "source": f"hf://org/{name}-lora"})

    def loaded(name: str) -> bool:
        return status(kube, "loraadapters", name).get("ready") == "True"

    wait_for(lambda: loaded("alpha") and loaded("beta"), 90, f"alpha and beta loaded\n{served.logs()}", every=0.5)
    print(f"lora e2e: sim Model created -> alpha and beta Ready: {time.monotonic() - started:.1f} s")
    # The Model may render before its adapters are seen: its first pod then runs without LoRA and
    # rolls to one that has it. Look at the pod once that roll is over.
    def settled() -> bool:
        pods = [p for p in kube.pods(f"{names.LABEL_MODEL}=chat") if not p.metadata.deletion_timestamp]
        return len(pods) == 1 and is_ready(pods[0]) and "--enable-lora" in (pods[0].spec.containers[0].args or [])

    wait_for(settled, 90, f"one ready pod started with LoRA\n{served.logs()}", every=0.5)
    (pod,) = _ready_pods(kube, "chat")
    engine = f"http://{pod.status.pod_ip}:{pod.spec.containers[0].ports[0].container_port}"
    args = pod.spec.containers[0].args
    assert args[args.index("--max-loras") + 1] == "2" and "--enable-lora" in args
    assert "wakegate.io/lora-adapters" not in (pod.metadata.annotations or {}), "vLLM pods start with none"
    # Routed only once its adapters are in: the readiness gate the operator opened.
    assert [g.condition_type for g in pod.spec.readiness_gates] == [GATE_ADAPTERS]
    assert any(c.type == GATE_ADAPTERS and c.status == "True" for c in pod.status.conditions)
    gamma = status(kube, "loraadapters", "gamma")
    assert (gamma["ready"], gamma["reason"]) == ("False", "MaxAdaptersExceeded"), gamma
    # The engine itself lists what the operator loaded into it.
    listed = json.loads(urllib.request.urlopen(f"{engine}/v1/models", timeout=10).read())
    assert {"alpha", "beta"} <= {m["id"] for m in listed["data"]} and "gamma" not in {m["id"] for m in listed["data"]}
    wait_for(lambda: ask(gateway.url, "alpha")[0] == 200, 60, f"alpha routed\n{served.logs()}")
    code, body = ask(gateway.url, "beta", "header")
    assert code == 200 and body["model"] == "beta", body
    assert ask(gateway.url, "gamma")[0] == 404

    # Removing an adapter unloads it and makes room for the next: no pod rolls.
    removed = time.monotonic()
    kube.custom.delete_namespaced_custom_object(GROUP, VERSION, kube.ns, "loraadapters", "alpha")
    wait_for(lambda: loaded("gamma"), 60, f"gamma loaded in alpha's place\n{served.logs()}", every=0.5)
    print(f"lora e2e: alpha deleted -> gamma Ready in its place: {time.monotonic() - removed:.1f} s")
    print("lora e2e: operator: " + " | ".join(line for line in served.operator.proc.tail(200).splitlines()
                                               if "loaded LoRAAdapter" in line))
    (same,) = _ready_pods(kube, "chat")
    assert same.metadata.uid == pod.metadata.uid
    listed = json.loads(urllib.request.urlopen(f"{engine}/v1/models", timeout=10).read())
    assert {"beta", "gamma"} <= {m["id"] for m in listed["data"]} and "alpha" not in {m["id"] for m in listed["data"]}
    assert status(kube, "loraadapters", "gamma")["replicas"] == [pod.metadata.name]


def test_the_first_request_for_a_vllm_adapter_of_a_base_at_zero_finds_it_loaded(served: Served) -> None:
    kube = served.kube
    # A load that takes the engine 2 s: without the readiness gate the woken pod would be routed,
    # and the held request released, before its adapter is in.
    create(kube, "models", "burst", {
        "backend": "sim", "args": ["--lora-load-ms", "2000"],
        "scaling": {"min": 0, "max": 1, "engine": "builtin", "idleTimeout": 300, "activationTimeout": 60},
    })
    create(kube, "loraadapters", "delta", {"baseModel": "burst", "source": "hf://org/delta-lora"})
    wait_for(lambda: status(kube, "loraadapters", "delta").get("reason") == "BaseNotReady", 60,
             f"delta waiting for a replica of its sleeping base\n{served.logs()}")
    settled(served, "burst")
    wait_for(lambda: ask(served.gateway.url, "nothing-here")[0] == 404, 30, "the gateway routing")
    code, body = ask(served.gateway.url, "delta", timeout=90)
    assert code == 200 and body["model"] == "delta", f"{body}\n{served.logs()}"
    assert served.scaler.tail(400).count(f"scaled {kube.ns}/burst to 1 replicas") == 1


def test_a_real_vllm_base_at_zero_loads_its_adapter_behind_the_readiness_gate(served: Served, tmp_path: Path) -> None:
    """Real vLLM (the CPU install e2e/engines.py keeps) as a pod from a generated Hugging Face
    folder on the node, and a LoRAAdapter of it (a PEFT folder on the node). The first request,
    for the adapter, wakes the base from zero; the operator loads the adapter through vLLM's own
    API (the pod's mount path, bound as a container runtime would) before the readiness gate lets
    the pod be routed, so that request is answered by the adapter; the base answers differently,
    and the adapter's answer is the same every time."""
    from e2e import engines, hfmodel
    from wakegate.control.backends import BACKENDS, Image
    from wakegate.control.runtimes import runtime_for

    try:
        engines.ensure("vllm")
    except engines.ToolchainMissing as exc:
        missing(str(exc))
    kube = served.kube
    spec = hfmodel.HFModelSpec(seed=0)
    base = hfmodel.write_model(tmp_path / "node" / "tiny", spec)
    adapter = hfmodel.write_lora(tmp_path / "node" / "sql", spec, seed=11)
    # vLLM's runtime as the plugin renders it, for a CPU image (the shipped ones are CUDA and ROCm).
    runtime = runtime_for(BACKENDS["vllm"], Image("cpu", "vllm/vllm-openai:latest"))
    runtime_name = f"vllm-cpu-{kube.ns}"  # InferenceRuntimes are cluster-wide
    runtime["metadata"] = {"name": runtime_name}
    kube.custom.create_cluster_custom_object(GROUP, VERSION, "inferenceruntimes", runtime)
    try:
        _vllm_adapter_round(served, base, adapter, runtime_name)
    finally:
        kube.custom.delete_cluster_custom_object(GROUP, VERSION, "inferenceruntimes", runtime_name)


def _vllm_adapter_round(served: Served, base: Path, adapter: Path, runtime: str) -> None:
    kube = served.kube
    create(kube, "models", "vbase", {
        "backend": "vllm", "source": f"file://{base}", "runtimeRef": {"name": runtime},
        "args": ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager"],
        "adapters": {"maxAdapters": 1},
        "scaling": {"min": 0, "max": 1, "engine": "builtin", "idleTimeout": 600, "activationTimeout": 400},
    })
    create(kube, "loraadapters", "vsql", {"baseModel": "vbase", "source": f"file://{adapter}"})
    settled(served, "vbase")
    wait_for(lambda: ask(served.gateway.url, "nothing-here")[0] == 404, 30, "the gateway routing")
    started = time.monotonic()
    first = text(ask(served.gateway.url, "vsql", timeout=450))
    print(f"lora e2e: vLLM base woken for its adapter, answered in {time.monotonic() - started:.1f} s")
    (pod,) = _ready_pods(kube, "vbase")
    assert [g.condition_type for g in pod.spec.readiness_gates] == [GATE_ADAPTERS]
    engine = f"http://{pod.status.pod_ip}:{pod.spec.containers[0].ports[0].container_port}"
    listed = json.loads(urllib.request.urlopen(f"{engine}/v1/models", timeout=10).read())
    assert "vsql" in {m["id"] for m in listed["data"]}, listed
    assert status(kube, "loraadapters", "vsql")["ready"] == "True"
    answers = [text(ask(served.gateway.url, m, timeout=120)) for m in ("vbase", "vsql", "vbase", "vsql")]
    assert answers[1] == answers[3] == first and answers[0] == answers[2] != first, answers
    assert served.scaler.tail(400).count(f"scaled {kube.ns}/vbase to 1 replicas") == 1
