"""The federation's decisions over plain data: placement, the global routes, the one wake, statuses."""

from __future__ import annotations

import json

import pytest

from wakegate.control.federation import members as fed
from wakegate.control.federation.members import MemberHealth, MemberReport, ModelReport
from wakegate.control.federation_schema import parse_federation

FILE = """
apiVersion: wakegate.io/v1alpha1
kind: Cluster
metadata: {name: east, labels: {tier: gpu}}
spec: {gateway: {url: "http://10.0.0.1:8080"}, gpus: 2}
---
apiVersion: wakegate.io/v1alpha1
kind: Cluster
metadata: {name: west, labels: {tier: gpu}}
spec: {gateway: {url: "http://10.0.0.2:8080"}, gpus: 8}
---
apiVersion: wakegate.io/v1alpha1
kind: Cluster
metadata: {name: lab, labels: {tier: cpu}}
spec: {gateway: {url: "http://10.0.0.3:8080"}}
---
apiVersion: wakegate.io/v1alpha1
kind: FederatedModel
metadata: {name: chat}
spec:
  template: {backend: sim, servedName: org/chat, aliases: [small], endpoint: {maxQueue: 7}}
  placement: {clusterSelector: {tier: gpu}, min: 0, max: 2}
"""


def federation(text: str = FILE):  # type: ignore[no-untyped-def]
    parsed = parse_federation(text, "f.yaml")
    return parsed.models[0], [fed.member_of(c) for c in parsed.clusters]


def report(
    ready: int, queued: int = 0, in_flight: int = 0, names: tuple[str, ...] = ("chat", "org/chat")
) -> MemberReport:
    model = ModelReport(names[0], names, ready, queued, in_flight)
    return MemberReport(True, {name: model for name in names})


def up(rep: MemberReport, latency: float = 0.01) -> MemberHealth:
    return MemberHealth().observed(rep, latency, now=100.0)


def test_placement_follows_the_selector_then_failover_order() -> None:
    model, members = federation()
    assert [m.name for m in fed.placed(model, members)] == ["east", "west"]
    model, members = federation(FILE.replace("max: 2}", "max: 2, failover: [west]}"))
    assert [m.name for m in fed.placed(model, members)] == ["west", "east"]
    model, members = federation(FILE.replace("clusterSelector: {tier: gpu}", "clusters: [lab]"))
    assert [m.name for m in fed.placed(model, members)] == ["lab"]


def test_routes_hold_only_members_that_are_reachable_and_report_the_model_ready() -> None:
    model, members = federation()
    health = {
        "east": up(report(ready=1, queued=2, in_flight=3)),
        "west": up(report(ready=0)),  # serves it, cold
        "lab": up(report(ready=1)),  # warm, but not placed
    }
    (route,) = fed.global_routes([model], members, health)
    assert route.endpoints == (("10.0.0.1", 8080),)
    assert route.loads == (("10.0.0.1", 8080, 5),)  # held + in flight: extproc's least-loaded signal
    assert route.names == ("chat", "org/chat", "small") and route.max_queue == 7
    assert (route.cold_mode, route.strategy) == ("hold", "least-loaded")
    health["west"] = up(report(ready=1))
    assert fed.global_routes([model], members, health)[0].endpoints == (("10.0.0.1", 8080), ("10.0.0.2", 8080))
    health["east"] = health["east"].failed("unreachable: ClientConnectorError", threshold=1)
    assert fed.global_routes([model], members, health)[0].endpoints == (("10.0.0.2", 8080),)


def test_routes_carry_each_members_weight_to_the_pick() -> None:
    from collections import Counter

    from wakegate.control.feeder.model_routes import model_route
    from wakegate.extproc.picking import Picker

    text = FILE.replace("gpus: 2}", "gpus: 2, weight: 300}")
    model, members = federation(text)
    health = {"east": up(report(ready=1, queued=1)), "west": up(report(ready=1, queued=1))}
    (route,) = fed.global_routes([model], members, health)
    assert route.endpoint_weights == (("10.0.0.1", 8080, 300), ("10.0.0.2", 8080, 100))
    proto = model_route(route)
    assert [(e.address, e.weight) for e in proto.endpoints] == [("10.0.0.1", 300), ("10.0.0.2", 100)]
    # What extproc does with the route (service._forward): equally loaded members split 3 : 1.
    endpoints = [f"{e.address}:{e.port}" for e in proto.endpoints]
    loads = {f"{e.address}:{e.port}": e.engine_load for e in proto.endpoints}
    weights = {f"{e.address}:{e.port}": e.weight for e in proto.endpoints}
    picker = Picker()
    picks = Counter(
        picker.pick(route.key, "least-loaded", endpoints, {}, None, loads, shares=weights) for _ in range(2000)
    )
    assert abs(picks["10.0.0.1:8080"] / 2000 - 0.75) < 0.02
    # A busier member is not picked for its weight.
    health["east"] = up(report(ready=1, queued=5))
    (route,) = fed.global_routes([model], members, health)
    proto = model_route(route)
    loads = {f"{e.address}:{e.port}": e.engine_load for e in proto.endpoints}
    assert {picker.pick(route.key, "least-loaded", endpoints, {}, None, loads, shares=weights) for _ in range(10)} == {
        "10.0.0.2:8080"
    }


def test_an_https_member_is_an_endpoint_only_with_its_tls() -> None:
    from wakegate.control.feeder.routed import UpstreamTls

    model, members = federation(FILE.replace('"http://10.0.0.1:8080"}', '"https://10.0.0.1:8443", caFile: ca.pem}'))
    assert members[0].tls and members[0].server_name is None and not members[1].tls
    health = {"east": up(report(ready=1)), "west": up(report(ready=1))}
    (route,) = fed.global_routes([model], members, health)
    assert route.endpoints == (("10.0.0.2", 8080),) and route.endpoint_tls == ()  # never plain text to east
    tls = UpstreamTls("east", "/state/ca.pem", ip_san="10.0.0.1")
    (route,) = fed.global_routes([model], members, health, tls={"east": tls})
    assert route.endpoints == (("10.0.0.1", 8443), ("10.0.0.2", 8080))
    assert route.endpoint_tls == (("10.0.0.1", 8443, tls),)


def test_a_member_that_does_not_serve_the_model_is_never_its_endpoint() -> None:
    model, members = federation()
    health = {"east": up(report(ready=3, names=("other",))), "west": up(report(ready=1, names=("small",)))}
    assert fed.global_routes([model], members, health)[0].endpoints == (("10.0.0.2", 8080),)
    assert fed.wake_target(model, members, {"east": health["east"]}) is None


def test_fill_first_routes_to_the_first_warm_member_only() -> None:
    model, members = federation(FILE.replace("max: 2}", "max: 2, mode: fill-first, failover: [west, east]}"))
    health = {"east": up(report(ready=1)), "west": up(report(ready=1))}
    assert fed.global_routes([model], members, health)[0].endpoints == (("10.0.0.2", 8080),)
    health["west"] = health["west"].failed("no answer in 1s", threshold=1)
    assert fed.global_routes([model], members, health)[0].endpoints == (("10.0.0.1", 8080),)


def test_a_member_leaves_only_after_the_threshold_of_failed_probes() -> None:
    state = up(report(ready=1))
    once = state.failed("no answer in 1s", threshold=2)
    assert once.reachable and once.failures == 1
    twice = once.failed("no answer in 1s", threshold=2)
    assert not twice.reachable and twice.reason == "no answer in 1s"
    assert twice.observed(report(ready=1), 0.01, 200.0).reachable


def test_one_member_is_woken_first_in_failover_order_then_the_next_if_it_failed() -> None:
    model, members = federation(FILE.replace("max: 2}", "max: 2, failover: [west, east]}"))
    health = {"east": up(report(ready=0)), "west": up(report(ready=0))}
    first = fed.wake_target(model, members, health)
    assert first is not None and first.name == "west"
    second = fed.wake_target(model, members, health, tried={"west"})
    assert second is not None and second.name == "east"
    assert fed.wake_target(model, members, health, tried={"west", "east"}) is None
    health["west"] = health["west"].failed("unreachable", threshold=1)
    again = fed.wake_target(model, members, health)
    assert again is not None and again.name == "east"


def test_without_failover_order_the_member_with_most_accelerators_wakes() -> None:
    model, members = federation()
    health = {"east": up(report(ready=0), latency=0.001), "west": up(report(ready=0), latency=0.2)}
    target = fed.wake_target(model, members, health)
    assert target is not None and target.name == "west"  # 8 GPUs beat 2, whatever the latency


def test_status_answers_parse_and_bad_ones_are_refused() -> None:
    body = json.dumps(
        {
            "synced": True,
            "models": [
                {
                    "model": "chat",
                    "names": ["chat", "small"],
                    "ready_endpoints": 2,
                    "queued": 1,
                    "in_flight": 4,
                    "max_queue": 100,
                }
            ],
        }
    ).encode()
    parsed = fed.parse_status(body)
    found = parsed.find(["nope", "small"])
    assert found is not None and (found.model, found.ready_endpoints, found.load) == ("chat", 2, 5)
    for bad in (b"", b"[]", b'{"models": [{"model": "x"}]}', b'{"models": [{"model": "x", "ready_endpoints": "a"}]}'):
        with pytest.raises(ValueError, match="not a wakegate status answer"):
            fed.parse_status(bad)
    with pytest.raises(ValueError, match="over"):
        fed.parse_status(b" " * (fed.MAX_STATUS_BYTES + 1))


def test_a_member_url_must_be_an_ip_the_global_envoy_can_use() -> None:
    with pytest.raises(ValueError, match=r"'gw\.example' is not an IP address"):
        federation(FILE.replace("10.0.0.1", "gw.example", 1))


def test_member_models_carry_the_template_with_the_placement_bounds() -> None:
    model, _ = federation()
    body = fed.member_model(model, "serving")
    assert body["metadata"] == {"name": "chat", "namespace": "serving", "labels": {fed.FEDERATED_LABEL: "chat"}}
    assert body["spec"]["scaling"] == {"min": 0, "max": 2}
    assert body["spec"]["servedName"] == "org/chat" and body["spec"]["endpoint"] == {"maxQueue": 7}


def test_statuses_show_reachability_and_per_cluster_readiness() -> None:
    model, members = federation()
    health = {"east": up(report(ready=1)), "west": MemberHealth().failed("unreachable: ClientConnectorError", 1)}
    status = fed.federated_status(model, members, health)
    assert status["summary"] == "east=Ready west=Unreachable"
    assert (status["placed"], status["readyClusters"]) == (2, 1)
    health["west"] = up(report(ready=0))
    status = fed.federated_status(model, members, health, {"east": {"phase": "Ready", "readyReplicas": 2}})
    assert status["summary"] == "east=Ready west=Idle" and status["clusters"][0]["readyReplicas"] == 2
    cluster = fed.cluster_status(health["east"], 0.0)
    assert (
        cluster["reachable"] == "True" and cluster["readyModels"] == 1 and cluster["lastSeen"] == "1970-01-01T00:00:00Z"
    )
    assert fed.cluster_status(health["west"].failed("no answer in 1s", 1), None)["reachable"] == "False"
    assert fed.cluster_status(None, None)["reachable"] == "Unknown"


def test_capacity_counts_allocatable_accelerators_and_what_live_pods_request() -> None:
    nodes = [
        {"status": {"allocatable": {"nvidia.com/gpu": "4", "cpu": "8"}}},
        {"status": {"allocatable": {"amd.com/gpu": "2"}}},
        {"status": {}},
    ]
    gpu = {"resources": {"requests": {"nvidia.com/gpu": "1"}}}
    pods = [
        {"status": {"phase": "Running"}, "spec": {"containers": [gpu, gpu]}},
        {"status": {"phase": "Pending"}, "spec": {"containers": [gpu]}},
        {"status": {"phase": "Succeeded"}, "spec": {"containers": [gpu]}},  # done: holds nothing
        {"status": {"phase": "Running"}, "spec": {"containers": [{"resources": {}}]}},
    ]
    summary = fed.gpu_summary(nodes, pods)
    assert summary == {"total": 6, "allocated": 3}
    assert fed.free_gpus({"gpus": summary}) == 3
    assert fed.free_gpus({"gpus": {"total": 1, "allocated": 4}}) == 0
    assert fed.free_gpus({}) is None and fed.free_gpus(None) is None
