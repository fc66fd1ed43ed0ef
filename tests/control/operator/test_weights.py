"""`cache: node|prewarm` Models: weights state from ModelCaches, rendering around it, and status."""

from __future__ import annotations

from typing import Any

from tests.control.operator.test_render import model, obj, shipped
from wakegate.control.k8s import names
from wakegate.control.k8s.objects import model_from_object, runtime_from_object
from wakegate.control.operator import render as rnd
from wakegate.control.operator.status import Observed, compute
from wakegate.control.operator.weights import State, Weights, cache_summary, weights_for

SOURCE = "oci://reg.example:5000/models/tiny:v1"
OLD = "sha256:" + "01" * 32
NEW = "sha256:" + "02" * 32
NOW = "2026-12-01T20:00:00Z"

#: The memory-backed /dev/shm every backend pod gets (the shipped runtimes' default size).
SHM = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}


def cached_model(strategy: str = "prewarm", **spec: Any) -> dict[str, Any]:
    return model(backend="llamacpp", source=SOURCE, cache={"strategy": strategy}, **spec)


def modelcache(name: str, *entries: dict[str, Any], owner: str | None = None, **spec: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "generation": 2}
    if owner is not None:
        meta["ownerReferences"] = [{"uid": owner}]
    return {"metadata": meta, "spec": {"sources": [SOURCE], **spec}, "status": {"nodes": list(entries)}}


def entry(node: str, phase: str, **extra: Any) -> dict[str, Any]:
    return {"node": node, "source": SOURCE, "phase": phase, **extra}


def state(body: dict[str, Any], *caches: dict[str, Any]) -> Weights:
    weights = weights_for(body, model_from_object(body), caches)
    assert weights is not None
    return weights


def render(body: dict[str, Any], weights: Weights | None) -> rnd.Rendered:
    rt = runtime_from_object(shipped("llamacpp"))
    return rnd.render(body, rt, rnd.Settings(node_cache_dir="/var/cache/wg"), weights=weights)


def conditions(weights: Weights) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in weights.conditions}


def test_strategy_none_reads_the_source_itself() -> None:
    body = model(backend="llamacpp", source=SOURCE)
    assert weights_for(body, model_from_object(body), [modelcache("c", entry("n1", "Ready", digest=NEW))]) is None


def test_prewarm_without_a_modelcache_gets_one_and_renders_no_pod_yet() -> None:
    body = cached_model()
    weights = state(body)
    assert weights.state is State.PENDING and weights.owned_cache is not None
    assert weights.owned_cache["metadata"]["name"] == names.owned_cache_name("m")
    assert weights.owned_cache["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert weights.owned_cache["spec"] == {"sources": [SOURCE], "modelRef": {"name": "m"}}
    out = render(body, weights)
    assert [o["kind"] for o in out.objects] == ["Service", "ModelCache"]  # no Deployment: no pod, no GPU
    assert out.autoscaling.reason == "WaitingForWeights"
    status = compute(Observed(1, None, [], out.autoscaling, weights=weights), {}, NOW)
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert status["phase"] == "Pending" and ready["reason"] == "WeightsPulling"
    pulling = next(c for c in status["conditions"] if c["type"] == "WeightsPulling")
    assert pulling["status"] == "True" and pulling["reason"] == "WaitingForNodes"


def test_a_modelcache_naming_the_model_replaces_the_owned_one() -> None:
    body = cached_model()
    theirs = modelcache("mine", entry("n1", "Pulling", bytesDone=5, bytesTotal=20), modelRef={"name": "m"})
    weights = state(body, theirs)
    assert weights.owned_cache is None
    assert weights.state is State.PULLING and "5 B / 20 B" in weights.message
    assert conditions(weights)["WeightsPulling"] == ("True", "Pulling")
    # the operator's own ModelCache does not count as "one naming it"
    ours = modelcache("wg-m", modelRef={"name": "m"}, owner="u-1")
    assert state(body, ours).owned_cache is not None


def test_strategy_node_uses_any_modelcache_with_the_weights_or_asks_for_them() -> None:
    body = cached_model("node")
    weights = state(body)
    assert weights.state is State.PENDING and weights.owned_cache is not None, "nobody has them: ask"
    # a ModelCache with the same source (any node selector) is enough; no ModelCache of ours then
    by_source = modelcache("zone-a", entry("n1", "Ready", digest=NEW, file="tiny.gguf"), nodeSelector={"z": "a"})
    covered = state(body, by_source)
    assert covered.state is State.READY and covered.owned_cache is None
    # prewarm is stricter: only a ModelCache naming the Model replaces its own
    assert state(cached_model("prewarm"), by_source).owned_cache is not None


def test_ready_weights_mount_the_newest_entry_and_pin_pods_to_the_nodes_holding_it() -> None:
    body = cached_model(resources={"gpu": {"count": 1, "vendor": "nvidia", "arch": ["sm90"]}})
    caches = modelcache(
        "c",
        entry("n1", "Ready", digest=OLD, file="tiny.gguf", readyTime="2026-12-01T19:00:00Z"),
        entry("n2", "Ready", digest=NEW, file="tiny.gguf", readyTime="2026-12-01T19:30:00Z"),
        entry("n3", "Ready", digest=NEW, file="tiny.gguf", readyTime="2026-12-01T19:10:00Z"),
        entry("n4", "Pulling", bytesDone=1),
        modelRef={"name": "m"},
    )
    weights = state(body, caches)
    assert weights.state is State.READY and weights.digest == NEW and weights.ready_nodes == ("n2", "n3")
    assert "ready on 2/4 node(s)" in weights.message
    assert conditions(weights) == {
        "WeightsPulling": ("False", "WeightsReady"),
        "PrewarmFailed": ("False", "NoFailures"),
    }
    out = render(body, weights)
    pod = obj(out, "Deployment")["spec"]["template"]
    spec = pod["spec"]
    entry_dir = "/var/cache/wg/entries/sha256-" + "02" * 32
    assert spec["volumes"] == [{"name": "weights", "hostPath": {"path": entry_dir, "type": "Directory"}}, SHM]
    container = spec["containers"][0]
    assert container["volumeMounts"] == [
        {"name": "weights", "mountPath": "/models/cache", "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    assert "/models/cache/files/tiny.gguf" in container["args"]
    term = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term == [
        {
            "matchExpressions": [
                {"key": names.NODE_GPU_ARCH, "operator": "In", "values": ["sm90"]},
                {"key": names.cache_label(NEW), "operator": "Exists"},
            ]
        }
    ]
    assert pod["metadata"]["annotations"][names.ANNOTATION_WEIGHTS] == NEW


def test_a_bad_reference_everywhere_is_prewarm_failed_with_the_reason() -> None:
    body = cached_model()
    caches = modelcache(
        "wg-m",
        entry("n1", "Failed", reason="not_found", message="oci://…:nope: the registry has no tag nope"),
        entry("n2", "Failed", reason="not_found", message="same"),
        owner="u-1",
        modelRef={"name": "m"},
    )
    weights = state(body, caches)
    assert weights.state is State.FAILED
    assert conditions(weights)["PrewarmFailed"] == ("True", "not_found")
    assert weights.message == "node n1: oci://…:nope: the registry has no tag nope (and 1 more node(s))"
    status = compute(Observed(1, None, [], render(body, weights).autoscaling, weights=weights), {}, NOW)
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert status["phase"] == "Failed" and ready["reason"] == "PrewarmFailed"
    # one node still pulling: not failed yet, but the failure is visible
    partly = state(
        body,
        modelcache("c", entry("n1", "Failed", reason="unreachable"), entry("n2", "Pulling"), modelRef={"name": "m"}),
    )
    assert partly.state is State.PULLING and conditions(partly)["PrewarmFailed"] == ("True", "unreachable")


def test_cache_summary_counts_nodes_ready_for_every_source() -> None:
    two = modelcache("c", entry("n1", "Ready", digest=NEW), entry("n2", "Pulling"))
    two["spec"]["sources"] = [SOURCE]
    summary = cache_summary(two, {}, NOW)
    assert (summary["readyNodes"], summary["wantedNodes"], summary["ready"]) == (1, 2, "1/2")
    assert summary["conditions"][0]["reason"] == "Pulling" and summary["observedGeneration"] == 2
    done = modelcache("c", entry("n1", "Ready", digest=NEW))
    first = cache_summary(done, {}, NOW)
    assert first["conditions"][0]["status"] == "True"
    # unchanged: the same summary, transition time kept (no write)
    assert cache_summary(done, first, "2026-12-01T21:00:00Z") == first
    bad = cache_summary(modelcache("c", entry("n1", "Failed", reason="not_found", message="no tag")), {}, NOW)
    assert bad["conditions"][0]["reason"] == "not_found" and bad["ready"] == "0/1"
    assert cache_summary(modelcache("c"), {}, NOW)["conditions"][0]["reason"] == "NoNodes"


def test_a_source_read_in_place_cannot_be_cached() -> None:
    body = model(backend="llamacpp", source="file:///models/tiny.gguf", cache={"strategy": "prewarm"})
    weights = state(body)
    assert weights.state is State.FAILED and weights.owned_cache is None
    assert conditions(weights)["PrewarmFailed"] == ("True", "bad_source")
    assert "needs an oci:// or hf:// source" in weights.message
    assert [o["kind"] for o in render(body, weights).objects] == ["Service"]


def test_an_invalid_modelcache_says_so_in_its_summary() -> None:
    summary = cache_summary(modelcache("c"), {}, NOW, invalid="spec.sources: a node cache holds oci:// and hf://")
    assert summary["conditions"][0]["reason"] == "InvalidSpec"
    assert "a node cache holds" in summary["conditions"][0]["message"]
