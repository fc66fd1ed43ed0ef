"""LoRAAdapters on a cluster, the pure parts: which adapters a base serves (and why not), what its
pods start with, and the status `kubectl get loraadapters` shows."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from wakegate.control.k8s import adapters as ad
from wakegate.control.k8s.objects import model_from_object, runtime_from_object
from wakegate.control.operator import render as rnd
from wakegate.control.operator.lora_status import AdapterObserved, adapter_status, started_with
from wakegate.control.runtimes import shipped_runtimes
from wakegate.control.schema import Model


def model_body(name: str = "tiny", backend: str = "llamacpp", **spec: Any) -> dict[str, Any]:
    source = {"source": "file:///weights/tiny.gguf"} if backend == "llamacpp" else {}
    return {
        "apiVersion": "wakegate.io/v1alpha1",
        "kind": "Model",
        "metadata": {"name": name, "namespace": "ns", "uid": "u-1", "generation": 1},
        "spec": {"backend": backend, **source, "scaling": {"min": 1, "max": 1, "engine": "builtin"}, **spec},
    }


def adapter(name: str, base: str = "tiny", created: str = "2026-12-01T10:00:00Z", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "wakegate.io/v1alpha1",
        "kind": "LoRAAdapter",
        "metadata": {"name": name, "namespace": "ns", "creationTimestamp": created, "generation": 1},
        "spec": {"baseModel": base, "source": f"file:///weights/{name}.gguf", **spec},
    }


def models(*bodies: dict[str, Any]) -> dict[str, Model | None]:
    return {b["metadata"]["name"]: model_from_object(b) for b in bodies}


def served(selection: ad.Selection, base: str = "tiny") -> list[str]:
    return [a.name for a in selection.of(base)]


def test_ids_follow_creation_so_a_new_adapter_takes_the_next_one() -> None:
    base = models(model_body())
    first = ad.select(
        base, [adapter("zeta", created="2026-12-01T10:00:00Z"), adapter("alpha", created="2026-12-01T10:00:05Z")]
    )
    assert served(first) == ["zeta", "alpha"]
    later = ad.select(
        base,
        [
            adapter("zeta", created="2026-12-01T10:00:00Z"),
            adapter("alpha", created="2026-12-01T10:00:05Z"),
            adapter("beta", created="2026-12-01T11:00:00Z"),
        ],
    )
    assert served(later) == ["zeta", "alpha", "beta"]
    same_second = ad.select(base, [adapter("b"), adapter("a")])
    assert served(same_second) == ["a", "b"], "a tie is broken by name, the same for operator and feeder"


@pytest.mark.parametrize(
    ("base", "body", "reason", "needle"),
    [
        (model_body(), adapter("x", base="nothing"), ad.BASE_NOT_FOUND, "'nothing'"),
        (model_body(backend="ollama", source="file:///w/t.gguf"), adapter("x"), ad.BACKEND_CANNOT, "ollama"),
        (model_body(), adapter("x", source="hf://org/x"), ad.SOURCE_UNSUPPORTED, "GGUF"),
        (model_body(), adapter("x", source="oci://reg.example/x:v1"), ad.SOURCE_UNSUPPORTED, "pvc://"),
        (model_body(), adapter("x", source="file://relative/x.gguf"), ad.SOURCE_UNSUPPORTED, "absolute"),
        (model_body(aliases=["x-v1"]), adapter("x", aliases=["x-v1"]), ad.NAME_CONFLICT, "'x-v1'"),
        (model_body(), adapter("x", scale=1000), ad.INVALID_SPEC, "spec.scale"),
    ],
)
def test_a_refused_adapter_says_why(base: dict[str, Any], body: dict[str, Any], reason: str, needle: str) -> None:
    selection = ad.select(models(base), [body])
    assert served(selection) == []
    assert selection.refused["x"].reason == reason
    assert needle in selection.refused["x"].message


def test_a_base_serves_at_most_max_adapters_and_a_base_that_does_not_parse_is_named() -> None:
    bodies = [adapter(f"a{i}", created=f"2026-12-01T10:00:0{i}Z") for i in range(4)]
    selection = ad.select(models(model_body(adapters={"maxAdapters": 3})), bodies)
    assert served(selection) == ["a0", "a1", "a2"]
    assert selection.refused["a3"].reason == ad.TOO_MANY and "(3)" in selection.refused["a3"].message
    broken = ad.select({"tiny": None}, [adapter("x")])
    assert broken.refused["x"].reason == ad.BASE_INVALID


def test_vllm_adapters_come_from_hf_pvc_or_oci_as_folders() -> None:
    base = models(model_body(name="chat", backend="vllm", source="hf://org/base"))
    bodies = [
        adapter("h", base="chat", source="hf://org/h-lora"),
        adapter("o", base="chat", source="oci://reg.example/x:1"),
        adapter("p", base="chat", source="pvc://loras/p"),
    ]
    selection = ad.select(base, bodies)
    assert served(selection, "chat") == ["h", "o", "p"]
    mounts = {a.name: ad.adapter_mount(a, "vllm") for a in selection.of("chat")}
    assert mounts["h"] == ad.Mounted("org/h-lora")
    assert mounts["o"].argument.startswith(ad.ADAPTERS_ROOT) and "image" in mounts["o"].volumes[0]
    assert mounts["p"].argument.endswith("/loras/p")
    assert mounts["p"].volumes[0]["persistentVolumeClaim"] == {"claimName": "loras", "readOnly": True}


def runtime(name: str) -> Any:
    return runtime_from_object(next(r for r in shipped_runtimes() if r["metadata"]["name"] == name))


def render(body: dict[str, Any], names_: list[str], rt: str) -> rnd.Rendered:
    """`body` rendered with adapters created in the order of `names_` (ORG/NAME: from hf://)."""
    base = body["metadata"]["name"]
    bodies = [
        adapter(
            n.rsplit("/", 1)[-1],
            base=base,
            created=f"2026-12-01T10:00:0{i}Z",
            **({"source": f"hf://{n}"} if "/" in n else {}),
        )
        for i, n in enumerate(names_)
    ]
    selection = ad.select(models(body), bodies)
    return rnd.render(body, runtime(rt), rnd.Settings(), adapters=selection.of(body["metadata"]["name"]))


def pod_spec(rendered: rnd.Rendered) -> dict[str, Any]:
    deployment = next(o for o in rendered.objects if o["kind"] == "Deployment")
    return dict(deployment["spec"]["template"])


def test_llama_cpp_pods_start_with_every_adapter_and_a_new_one_rolls_them() -> None:
    body = model_body(args=["--threads", "1"])
    one, two = render(body, ["sql"], "llamacpp"), render(body, ["sql", "poet"], "llamacpp")
    template = pod_spec(two)
    container = template["spec"]["containers"][0]
    args = container["args"]
    start = args.index("--lora-init-without-apply")
    loras = args[start + 1 : start + 5]
    assert loras[0::2] == ["--lora", "--lora"]
    assert [p.rsplit("/", 1)[1] for p in loras[1::2]] == ["sql.gguf", "poet.gguf"]
    assert args[-2:] == ["--threads", "1"], "the Model's own arguments come last"
    # Both adapters live in one node folder: one read-only volume for both.
    lora_volumes = [v for v in template["spec"]["volumes"] if v["name"].startswith("lora-")]
    assert lora_volumes == [{"name": lora_volumes[0]["name"], "hostPath": {"path": "/weights", "type": "Directory"}}]
    mount = next(m for m in container["volumeMounts"] if m["name"] == lora_volumes[0]["name"])
    assert mount["readOnly"] is True and loras[1].startswith(mount["mountPath"] + "/")
    assert template["metadata"]["annotations"][ad.ANNOTATION_ADAPTERS] == "sql,poet"
    assert "readinessGates" not in template["spec"], "a llama.cpp pod has its adapters when it answers"
    assert one.digest() != two.digest(), "llama.cpp loads adapters only at start: the pods roll"
    assert (
        "--lora" not in pod_spec(rnd.render(body, runtime("llamacpp"), rnd.Settings()))["spec"]["containers"][0]["args"]
    )


def test_vllm_pods_start_able_to_load_and_a_new_adapter_rolls_nothing() -> None:
    body = model_body(name="chat", backend="sim", adapters={"maxAdapters": 3})
    one, two = render(body, ["org/a"], "sim"), render(body, ["org/a", "org/b"], "sim")
    template = pod_spec(two)
    container = template["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--enable-lora") :][:3] == ["--enable-lora", "--max-loras", "3"]
    assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"} in container["env"]
    assert ad.ANNOTATION_ADAPTERS not in template["metadata"]["annotations"]
    assert template["spec"]["readinessGates"] == [{"conditionType": ad.GATE_ADAPTERS}], "routed once loaded"
    assert one.digest() == two.digest(), "the operator loads the new adapter into the running pods"
    assert (
        "--enable-lora"
        not in pod_spec(rnd.render(body, runtime("sim"), rnd.Settings()))["spec"]["containers"][0]["args"]
    )


def pod(name: str, adapters: str | None, ready: bool = True, since: str = "2026-12-01T10:00:00Z") -> dict[str, Any]:
    annotations = {ad.ANNOTATION_ADAPTERS: adapters} if adapters is not None else {}
    conditions = [{"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": since}]
    return {"metadata": {"name": name, "annotations": annotations}, "status": {"conditions": conditions}}


def test_llama_cpp_holders_are_the_ready_pods_that_started_with_the_adapter() -> None:
    pods = [
        pod("new", "sql,poet", since="2026-12-01T10:05:00Z"),
        pod("old", "sql"),
        pod("loading", "sql,poet", ready=False),
    ]
    assert started_with(pods, "poet") == {"new": "2026-12-01T10:05:00Z"}
    assert started_with(pods, "sql") == {"new": "2026-12-01T10:05:00Z", "old": "2026-12-01T10:00:00Z"}
    assert started_with(pods, "sq") == {}, "whole names only"


NOW = "2026-12-01T12:00:00Z"


def test_status_says_loaded_where_and_since_when_and_keeps_its_transition_time() -> None:
    observed = AdapterObserved(
        generation=2,
        base="tiny",
        holders={"p2": "2026-12-01T10:05:00Z", "p1": "2026-12-01T10:00:00Z"},
        ready_replicas=3,
        loads=2,
    )
    status = adapter_status(observed, {}, NOW)
    assert (status["ready"], status["reason"], status["loadedReplicas"], status["replicas"]) == (
        "True",
        "Loaded",
        2,
        ["p1", "p2"],
    )
    assert status["lastLoadTime"] == "2026-12-01T10:05:00Z" and status["loads"] == 2
    assert status["message"] == "loaded on 2 of 3 ready replicas of Model tiny"
    again = adapter_status(
        AdapterObserved(generation=2, base="tiny", holders=observed.holders, ready_replicas=3, loads=2),
        status,
        "2026-12-01T13:00:00Z",
    )
    assert again == status, "an unchanged world computes an unchanged status (no write)"


@pytest.mark.parametrize(
    ("observed", "reason"),
    [
        (
            AdapterObserved(1, "tiny", refused=ad.Refused(ad.BASE_NOT_FOUND, "no Model 'tiny'"), holders={"p": "t"}),
            ad.BASE_NOT_FOUND,
        ),
        (
            AdapterObserved(1, "chat", ready_replicas=1, failure="pod p: HTTP 400: no room", loads=4, failures=2),
            "LoadFailed",
        ),
        (AdapterObserved(1, "tiny", ready_replicas=0), "BaseNotReady"),
        (AdapterObserved(1, "chat", ready_replicas=2), "Loading"),
        (AdapterObserved(1, "tiny", ready_replicas=1, at_start=True), "Loading"),
    ],
)
def test_status_tells_why_no_replica_holds_it(observed: AdapterObserved, reason: str) -> None:
    previous = {"loads": 4, "failures": 1, "lastLoadTime": "2026-12-01T09:00:00Z"}
    status = adapter_status(observed, previous, NOW)
    assert (status["ready"], status["reason"], status["loadedReplicas"], status["replicas"]) == ("False", reason, 0, [])
    assert status["conditions"][0]["reason"] == reason and status["conditions"][0]["lastTransitionTime"] == NOW
    assert (status["loads"], status["failures"]) == (observed.loads, observed.failures)
    if observed.at_start:
        assert "roll" in status["message"], "llama.cpp gets a new adapter by a roll of its pods"
    assert status["lastLoadTime"] == "2026-12-01T09:00:00Z", "the last load is remembered"


class Kube:
    """The API server as the reconcile sees it: applies and status patches echo, and are recorded."""

    def __init__(self) -> None:
        self.applied: list[dict[str, Any]] = []
        self.statuses: list[tuple[str, dict[str, Any]]] = []

    def get_or_none(self, resource: str) -> Any:
        return None

    def apply(self, obj: dict[str, Any], field_manager: str = "", force: bool = True) -> Any:
        self.applied.append(obj)
        return obj

    def delete(self, resource: str) -> bool:
        return False

    def patch_status(self, obj_path: str, status: dict[str, Any]) -> Any:
        self.statuses.append((obj_path, status))
        return {"status": status}

    def apply_status(self, obj: dict[str, Any], field_manager: str) -> Any:
        self.statuses.append((obj["metadata"]["name"], obj["status"]))
        return obj


def llama_pod(name: str, uid: str, adapters: str) -> dict[str, Any]:
    body = pod(name, adapters)
    body["metadata"].update(namespace="ns", uid=uid, labels={"wakegate.io/model": "tiny"})
    return body


def test_the_operator_renders_the_adapters_and_counts_each_pod_that_loads_one_once() -> None:
    from wakegate.control.operator.controller import Reconciler
    from wakegate.control.operator.keys import ADAPTER_KEY

    kube = Kube()
    reconciler = Reconciler(kube, rnd.Settings())  # type: ignore[arg-type]
    reconciler.on_adapter(None, adapter("sql"))
    asyncio.run(reconciler.reconcile(ADAPTER_KEY + "ns/sql"))
    path, status = kube.statuses[-1]
    assert path == "/apis/wakegate.io/v1alpha1/namespaces/ns/loraadapters/sql"
    assert (status["ready"], status["reason"]) == ("False", ad.BASE_NOT_FOUND)
    first = dict(reconciler.adapters["ns"]["sql"])  # the copy an event will bring back later

    reconciler.on_model(None, model_body())
    asyncio.run(reconciler.reconcile("ns/tiny"))
    deployment = next(o for o in kube.applied if o["kind"] == "Deployment")
    assert "--lora" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    reconciler.on_pod(None, llama_pod("p1", "u1", "sql"))
    asyncio.run(reconciler.reconcile(ADAPTER_KEY + "ns/sql"))
    assert (kube.statuses[-1][1]["replicas"], kube.statuses[-1][1]["loads"]) == (["p1"], 1)

    # A late watch event brings the status from before the load; the next pod is still load two.
    reconciler.on_adapter("MODIFIED", first)
    reconciler.on_pod("DELETED", llama_pod("p1", "u1", "sql"))
    reconciler.on_pod(None, llama_pod("p2", "u2", "sql"))
    asyncio.run(reconciler.reconcile(ADAPTER_KEY + "ns/sql"))
    assert (kube.statuses[-1][1]["replicas"], kube.statuses[-1][1]["loads"]) == (["p2"], 2)
    written = len(kube.statuses)
    asyncio.run(reconciler.reconcile(ADAPTER_KEY + "ns/sql"))
    assert len(kube.statuses) == written, "an unchanged world writes nothing"


def sim_pod(name: str, containers_ready: bool, gate: bool | None) -> dict[str, Any]:
    conditions = [
        {"type": "ContainersReady", "status": str(containers_ready), "lastTransitionTime": NOW},
        {"type": "Ready", "status": str(containers_ready and bool(gate)), "lastTransitionTime": NOW},
    ]
    if gate is not None:
        conditions.append({"type": ad.GATE_ADAPTERS, "status": str(gate)})
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}", "labels": {"wakegate.io/model": "chat"}},
        "spec": {
            "readinessGates": [{"conditionType": ad.GATE_ADAPTERS}],
            "containers": [{"name": "backend", "ports": [{"name": "http", "containerPort": 1}]}],
        },
        "status": {"podIP": "10.0.0.1", "conditions": conditions},
    }


def test_a_vllm_pod_is_gated_until_its_adapters_are_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    from wakegate.control.operator import lora_loading
    from wakegate.control.operator.controller import Reconciler

    async def engine(session: Any, endpoint: str, path: str, body: Any) -> tuple[int, str]:
        return (200, "ok") if path == "/v1/load_lora_adapter" else (404, "")

    monkeypatch.setattr(lora_loading, "_post", engine)
    kube = Kube()
    reconciler = Reconciler(kube, rnd.Settings())  # type: ignore[arg-type]
    reconciler.on_model(None, model_body(name="chat", backend="sim"))
    reconciler.on_adapter(None, adapter("a", base="chat", source="hf://org/a"))
    reconciler.on_pod(None, sim_pod("up", containers_ready=True, gate=None))
    reconciler.on_pod(None, sim_pod("starting", containers_ready=False, gate=None))
    reconciler.on_pod(None, sim_pod("restarted", containers_ready=False, gate=True))
    asyncio.run(reconciler.reconcile("ns/chat"))
    gates = {
        name: status["conditions"][0]["status"]
        for name, status in kube.statuses
        if status.get("conditions", [{}])[0].get("type") == ad.GATE_ADAPTERS
    }
    assert gates == {"up": "True", "restarted": "False"}, "open once loaded; closed while the engine is down"
    assert set(reconciler.lora_loader.holders("ns/a")) == {"up"}
