"""Filter rules, score formula and the facts they read, including bad and missing input."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.scheduler import node, pod
from wakegate.control.backends import Backend, Image
from wakegate.control.k8s import names
from wakegate.control.placement.facts import (
    NODE_COST_PER_HOUR,
    NODE_KV_CACHE_USAGE,
    NODE_TENANT_SHARE,
    NodeFacts,
    PodFacts,
    node_facts,
    number,
    pod_facts,
    pod_gpu_request,
)
from wakegate.control.placement.rules import (
    Weights,
    extender_priority,
    filter_node,
    kv_penalty,
    normalise,
    raw_score,
    tenant_adjustment,
)

# -- facts -----------------------------------------------------------------


@pytest.mark.parametrize(
    "raw", [None, "", "  ", "NaN", "nan", "inf", "-inf", "Infinity", "abc", "1e400", "-1", True, [], {}]
)
def test_number_treats_nan_ish_and_negative_input_as_unknown(raw: object) -> None:
    assert number(raw) is None


def test_number_parses_and_caps() -> None:
    assert number(" 42 ") == 42.0
    assert number("0") == 0.0
    assert number(7) == 7.0
    assert number("150", high=100.0) == 100.0


@given(st.one_of(st.text(), st.floats(allow_nan=True, allow_infinity=True), st.none(), st.integers()))
def test_number_never_raises_and_is_finite(raw: object) -> None:
    value = number(raw)
    assert value is None or (math.isfinite(value) and value >= 0)


def test_node_facts_missing_everything() -> None:
    facts = node_facts({"metadata": {"name": "n"}})
    assert facts == NodeFacts(name="n")
    assert facts.device_class is None and facts.free_ratio is None


def test_node_facts_reads_labels_and_annotations() -> None:
    raw = node(
        "n",
        util=55,
        annotations={
            NODE_COST_PER_HOUR: "2.5",
            NODE_KV_CACHE_USAGE: "0.9",
            NODE_TENANT_SHARE: '{"a": 0.5, "b": "x", "c": 2}',
        },
    )
    facts = node_facts(raw)
    assert facts.vendor == "nvidia" and facts.arch == "sm90" and facts.gpu_count == 4
    assert facts.device_class == "nvidia-sm90"
    assert facts.free_mb == 300000 and facts.utilization == 55 and facts.cost_per_hour == 2.5
    assert facts.kv_cache_usage == 0.9
    assert facts.tenant_share == {"a": 0.5, "c": 1.0}
    assert facts.free_ratio == pytest.approx(min(1.0, 300000 / (81920 * 4)))


@pytest.mark.parametrize("bad", ["not json", "[1,2]", '{"a": NaN}', "[" * 100000])
def test_node_facts_ignores_bad_tenant_share(bad: str) -> None:
    facts = node_facts(node("n", annotations={NODE_TENANT_SHARE: bad}))
    assert facts.tenant_share in ({}, {"a": 0.0}) or facts.tenant_share == {}


def test_node_facts_survive_garbage_metadata() -> None:
    assert node_facts({"metadata": {"name": "n", "labels": ["x"], "annotations": {"a": 1}}}).vendor is None
    assert node_facts({}).name == ""


def test_zero_vram_label_gives_unknown_free_ratio() -> None:
    assert node_facts(node("n", vram=0)).free_ratio is None
    assert node_facts(node("n", count=0)).free_ratio is None


def test_pod_gpu_request_sums_containers_and_takes_max_init() -> None:
    raw = {
        "spec": {
            "containers": [
                {"resources": {"limits": {"nvidia.com/gpu": "2"}, "requests": {"nvidia.com/gpu": "1"}}},
                {"resources": {"requests": {"nvidia.com/gpu": 1}}},
                {"resources": {}},
                {},
            ],
            "initContainers": [{"resources": {"limits": {"nvidia.com/gpu": "4"}}}],
        }
    }
    assert pod_gpu_request(raw) == {"nvidia.com/gpu": 4}
    assert pod_gpu_request({"spec": {"containers": "nope"}}) == {}
    assert pod_gpu_request({}) == {}


def test_pod_facts() -> None:
    facts = pod_facts(pod(gpus=2, resource="amd.com/gpu", vram="30000", backend="llamacpp", tenant="t"))
    assert facts.gpu_count == 2 and facts.gpu_vendor == "amd" and facts.vram_estimate_mb == 30000
    assert facts.backend == "llamacpp" and facts.model == "m1" and facts.tenant == "t"
    assert facts.vram_needed_mb == 60000
    assert pod_facts(pod(vram="NaN")).vram_estimate_mb is None


# -- filter ----------------------------------------------------------------


def check(p: dict[str, object], n: dict[str, object]) -> tuple[str, bool] | None:
    verdict = filter_node(pod_facts(p), node_facts(n))
    return None if verdict is None else (verdict.message, verdict.resolvable)


def test_fitting_node_passes() -> None:
    assert check(pod(), node("n")) is None


def test_pod_without_gpus_passes_any_node() -> None:
    assert check(pod(gpus=0), node("n", vendor=None, free=None)) is None


def test_node_without_vendor_label_is_rejected_unresolvably() -> None:
    message, resolvable = check(pod(), node("n", vendor=None)) or ("", True)
    assert names.NODE_GPU_VENDOR in message and "no GPU" in message
    assert not resolvable


def test_free_vram_below_estimate_times_count_is_rejected() -> None:
    message, resolvable = check(pod(gpus=2, vram=20000), node("n", free=39999)) or ("", False)
    assert message == "free VRAM 39999 MiB < 40000 MiB needed (2 GPU x 20000 MiB)"
    assert resolvable  # evicting pods may free VRAM
    assert check(pod(gpus=2, vram=20000), node("n", free=40000)) is None


def test_zero_free_vram_rejects_any_positive_estimate() -> None:
    assert check(pod(vram=1), node("n", free=0)) is not None
    assert check(pod(vram=0), node("n", free=0)) is None


@pytest.mark.parametrize("free", [None, "NaN", "-5", "lots"])
def test_unknown_free_vram_rejects_when_the_pod_has_an_estimate(free: str | None) -> None:
    message, resolvable = check(pod(), node("n", free=free)) or ("", True)
    assert "free VRAM unknown" in message and not resolvable
    assert check(pod(vram=None), node("n", free=free)) is None


@pytest.mark.parametrize("vram", [None, "NaN", "-1", "x"])
def test_missing_or_bad_estimate_skips_the_vram_rule(vram: str | None) -> None:
    assert check(pod(vram=vram), node("n", free=0)) is None


def test_arch_the_backend_does_not_support_is_rejected() -> None:
    message, resolvable = check(pod(backend="vllm-omni"), node("n", arch="sm80")) or ("", True)
    assert message == "backend vllm-omni does not support GPU arch sm80"
    assert not resolvable
    assert check(pod(backend="vllm-omni"), node("n", arch="sm90")) is None
    # llamacpp lists no archs: any arch of a vendor it supports
    assert check(pod(backend="llamacpp"), node("n", arch="sm61")) is None


def test_backend_vendor_and_unknown_arch() -> None:
    amd = node("n", vendor="amd", arch="gfx942")
    message, _ = check(pod(backend="vllm-omni", resource="amd.com/gpu"), amd) or ("", True)
    assert message == "backend vllm-omni does not support amd GPUs"  # its only image is CUDA's
    cuda_only = {
        "cuda": Backend(
            name="cuda",
            description="",
            program=("x",),
            args=(),
            default_port=1,
            health_path="/",
            images=(Image("nvidia", "x"),),
        )
    }
    verdict = filter_node(pod_facts(pod(backend="cuda", resource="amd.com/gpu")), node_facts(amd), cuda_only)
    assert verdict is not None and verdict.message == "backend cuda does not support amd GPUs"
    message, _ = check(pod(backend="vllm"), node("n", arch=None)) or ("", True)
    assert "needs a known GPU arch" in message
    # the simulator claims no vendor: anything goes
    assert check(pod(backend="sim"), node("n", arch="weird")) is None


def test_unknown_backend_and_vendor_mismatch_are_named() -> None:
    message, _ = check(pod(backend="nope"), node("n")) or ("", True)
    assert message == "unknown backend 'nope' (annotation wakegate.io/backend)"
    message, _ = check(pod(resource="amd.com/gpu"), node("n")) or ("", True)
    assert message == "pod requests amd GPUs, node has nvidia"


def test_every_failing_rule_is_listed() -> None:
    message, resolvable = check(pod(backend="vllm-omni", vram=500000), node("n", arch="sm80")) or ("", True)
    assert "sm80" in message and "free VRAM" in message and "; " in message
    assert not resolvable


def test_no_backend_annotation_skips_the_arch_rule() -> None:
    assert check(pod(backend=None), node("n", arch=None)) is None


# -- score -----------------------------------------------------------------

W = Weights()


def facts(**kw: object) -> NodeFacts:
    return NodeFacts(name="n", **kw)  # type: ignore[arg-type]


POD = PodFacts(name="p", namespace="ns", gpu_count=1, backend="vllm", model="m1")


def test_weights_defaults_and_env() -> None:
    assert Weights.from_env({}) == Weights(0.7, 0.2, 0.1, 0.3, 10.0, 5.0)
    env = {
        "SCHED_TPS_WEIGHT": "1.5",
        "SCHED_UTIL_WEIGHT": "0",
        "SCHED_COST_WEIGHT": " ",
        "SCHED_CACHE_WEIGHT": "-1",
        "SCHED_VRAM_FREE_WEIGHT": "2",
        "SCHED_TENANT_FAIRSHARE_WEIGHT": "3",
    }
    assert Weights.from_env(env) == Weights(1.5, 0.0, 0.1, -1.0, 2.0, 3.0)


@pytest.mark.parametrize("bad", ["NaN", "inf", "x"])
def test_weights_refuse_unusable_values(bad: str) -> None:
    with pytest.raises(ValueError, match="SCHED_TPS_WEIGHT"):
        Weights.from_env({"SCHED_TPS_WEIGHT": bad})


def test_formula_term_by_term() -> None:
    node_ = facts(
        vendor="nvidia",
        arch="sm90",
        gpu_count=2,
        vram_mb=1000,
        free_mb=1500,
        utilization=50,
        cost_per_hour=3,
        kv_cache_usage=0.95,
    )
    expected = 100 * 0.7 - 50 * 0.2 - 3 * 0.1 - 0.95 * 0.3 + 0.75 * 10.0 - (0.95 - 0.85) * 20
    assert raw_score(POD, node_, 100.0, W) == pytest.approx(expected)


def test_missing_inputs_score_zero() -> None:
    assert raw_score(POD, facts(), 0.0, W) == 0.0


@pytest.mark.parametrize("tps", [math.nan, math.inf, -math.inf, -5.0])
def test_nan_ish_throughput_counts_as_zero(tps: float) -> None:
    assert raw_score(POD, facts(), tps, W) == 0.0


def test_kv_penalty_only_above_threshold() -> None:
    assert kv_penalty(None) == 0.0
    assert kv_penalty(0.85) == 0.0
    assert kv_penalty(0.5) == 0.0
    assert kv_penalty(1.0) == pytest.approx(3.0)


def test_tenant_adjustment() -> None:
    p = PodFacts(name="p", namespace="ns", tenant="a")
    assert tenant_adjustment(p, facts(), 5.0) == 0.0
    assert tenant_adjustment(PodFacts(name="p", namespace="ns"), facts(tenant_share={"b": 1.0}), 5.0) == 0.0
    # a alone above its fair share of 1/2
    assert tenant_adjustment(p, facts(tenant_share={"a": 0.75, "b": 0.25}), 5.0) == pytest.approx(-1.25)
    # a not on the node yet: fair share 1/2 of a node b holds
    assert tenant_adjustment(p, facts(tenant_share={"b": 0.5}), 5.0) == pytest.approx(2.5)


def test_higher_throughput_wins() -> None:
    nodes = {"fast": raw_score(POD, facts(), 500, W), "slow": raw_score(POD, facts(), 100, W)}
    assert normalise(nodes) == {"fast": 100, "slow": 0}


def test_normalise_edges() -> None:
    assert normalise({}) == {}
    assert normalise({"only": -7.0}) == {"only": 100}
    assert normalise({"a": 1.0, "b": 1.0}) == {"a": 100, "b": 100}
    assert normalise({"a": math.nan, "b": 10.0, "c": 5.0}) == {"a": 0, "b": 100, "c": 50}
    assert normalise({"a": -10.0, "b": 10.0, "c": 0.0}) == {"a": 0, "b": 100, "c": 50}


def test_extender_priority_maps_0_100_to_0_10() -> None:
    assert [extender_priority(s) for s in (0, 4, 5, 50, 96, 100, 150, -3)] == [0, 0, 0, 5, 10, 10, 10, 0]


@given(st.dictionaries(st.text(min_size=1, max_size=5), st.floats(allow_nan=True, allow_infinity=True), max_size=8))
def test_normalised_scores_are_always_in_range(raw: dict[str, float]) -> None:
    scores = normalise(raw)
    assert set(scores) == set(raw)
    assert all(0 <= s <= 100 for s in scores.values())
    assert all(0 <= extender_priority(s) <= 10 for s in scores.values())


# -- weights in the node cache ------------------------------------------------

WEIGHTS = "sha256:" + "ef" * 32


def test_a_node_holding_the_pods_weights_scores_higher() -> None:
    warm = node("warm", free=100000)
    warm["metadata"]["labels"][names.cache_label(WEIGHTS)] = "ready"
    cold = node("cold", free=300000)  # more free VRAM: better on every other term
    wants = pod()
    wants["metadata"]["annotations"][names.ANNOTATION_WEIGHTS] = WEIGHTS
    facts = pod_facts(wants)
    assert facts.weights == WEIGHTS and node_facts(warm).holds(WEIGHTS) and not node_facts(cold).holds(WEIGHTS)
    scores = normalise(
        {n: raw_score(facts, node_facts(body), 0.0, Weights()) for n, body in (("warm", warm), ("cold", cold))}
    )
    assert scores == {"warm": 100, "cold": 0}
    # without the annotation the cache label means nothing, and the free VRAM decides
    plain = pod_facts(pod())
    assert raw_score(plain, node_facts(cold), 0.0, Weights()) > raw_score(plain, node_facts(warm), 0.0, Weights())
    # the weight is a knob: 0 turns it off
    off = Weights.from_env({"SCHED_WEIGHTS_CACHED_WEIGHT": "0"})
    assert raw_score(facts, node_facts(cold), 0.0, off) > raw_score(facts, node_facts(warm), 0.0, off)
