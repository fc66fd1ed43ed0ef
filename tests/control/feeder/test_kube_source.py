"""The feeder's Kubernetes source: Models + EndpointSlices -> RoutedModels; and replica ownership."""

from __future__ import annotations

from typing import Any

import pytest

from wakegate.control.feeder.kube_source import KubeSource, Listed, node_leaving, slice_endpoints
from wakegate.control.k8s import names
from wakegate.control.operator.controller import _replicas_owned_elsewhere


def model(name: str = "m", phase: str = "Ready", admitted: bool = True, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "wakegate.io/v1alpha1",
        "kind": "Model",
        "metadata": {"name": name, "namespace": "ns", "generation": 4},
        "spec": {"backend": "sim", **spec},
        "status": {
            "phase": phase,
            "admitted": admitted,
            "conditions": [{"type": "Ready", "status": "False", "message": "boom"}],
        },
    }


def endpoint_slice(name: str, model_name: str, *endpoints: tuple[str, bool | None, bool]) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns", "labels": names.backend_labels(model_name)},
        "ports": [{"name": "http", "port": 8000}],
        "endpoints": [
            {"addresses": [ip], "conditions": {k: v for k, v in (("ready", r), ("terminating", t)) if v is not None}}
            for ip, r, t in endpoints
        ],
    }


def test_ready_addresses_only() -> None:
    body = endpoint_slice("s", "m", ("10.0.0.1", True, False), ("10.0.0.2", False, False), ("10.0.0.3", None, False))
    body["endpoints"].append({"addresses": ["10.0.0.4"], "conditions": {"ready": True, "terminating": True}})
    assert slice_endpoints(body) == {("10.0.0.1", 8000), ("10.0.0.3", 8000)}
    assert slice_endpoints({"endpoints": body["endpoints"]}) == set()


def test_routed_models_from_models_and_slices() -> None:
    source = KubeSource()
    source.on_model(None, model(aliases=["alias"], endpoint={"coldMode": "reject", "maxQueue": 7}))
    source.on_slice(None, endpoint_slice("a", "m", ("10.0.0.1", True, False)))
    source.on_slice(None, endpoint_slice("b", "m", ("10.0.0.2", True, False)))
    (routed,) = source.routed()
    assert routed.key == "ns/m"
    assert routed.names == ("m", "alias")
    assert routed.endpoints == (("10.0.0.1", 8000), ("10.0.0.2", 8000))
    assert (routed.cold_mode, routed.max_queue, routed.generation) == ("reject", 7, 4)
    assert (routed.admitted, routed.failed_activations, routed.last_failure) == (True, 0, "")
    source.on_slice("DELETED", endpoint_slice("b", "m"))
    assert source.routed()[0].endpoints == (("10.0.0.1", 8000),)
    source.on_model("DELETED", model())
    assert source.routed() == []


def test_failures_count_entries_into_failed_and_admission_comes_from_status() -> None:
    source = KubeSource()
    source.on_model(None, model(phase="Failed"))
    source.on_model(None, model(phase="Failed"))
    (routed,) = source.routed()
    assert (routed.failed_activations, routed.last_failure) == (1, "boom")
    source.on_model(None, model(phase="Loading"))
    source.on_model(None, model(phase="Failed"))
    assert source.routed()[0].failed_activations == 2
    source.on_model(None, model(phase="Preempted", admitted=False))
    assert source.routed()[0].admitted is False


def test_slices_without_model_label_and_invalid_models_are_ignored() -> None:
    source = KubeSource()
    source.on_slice(None, {"metadata": {"name": "x", "namespace": "ns", "labels": {}}})
    source.on_model(None, {**model(), "spec": {"backend": "nope"}})
    assert source.routed() == []


def test_replica_ownership() -> None:
    def dep(*entries: tuple[str, str, bool]) -> dict[str, Any]:
        return {
            "metadata": {
                "managedFields": [
                    {"manager": m, "operation": op, "fieldsV1": {"f:spec": {"f:replicas": {}} if owns else {}}}
                    for m, op, owns in entries
                ]
            }
        }

    assert not _replicas_owned_elsewhere(dep((names.FIELD_MANAGER, "Apply", True)))
    scaled = dep((names.FIELD_MANAGER, "Apply", False), (names.SCALER_FIELD_MANAGER, "Update", True))
    assert _replicas_owned_elsewhere(scaled)
    assert not _replicas_owned_elsewhere(dep(("kube-controller-manager", "Update", False)))


def on_nodes(body: dict[str, Any], nodes: dict[str, str]) -> dict[str, Any]:
    for endpoint in body["endpoints"]:
        endpoint["nodeName"] = nodes[endpoint["addresses"][0]]
    return body


def node(
    name: str,
    unschedulable: bool = False,
    taints: tuple[tuple[str, str], ...] = (),
    conditions: tuple[tuple[str, str], ...] = (),
) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {"unschedulable": unschedulable, "taints": [{"key": k, "effect": e} for k, e in taints]},
        "status": {
            "conditions": [{"type": "Ready", "status": "True"}, *({"type": t, "status": v} for t, v in conditions)]
        },
    }


@pytest.mark.parametrize(
    ("body", "leaving"),
    [
        (node("n"), False),
        (node("n", unschedulable=True), True),
        (node("n", taints=(("node.kubernetes.io/unschedulable", "NoSchedule"),)), True),
        (node("n", taints=(("ToBeDeletedByClusterAutoscaler", "NoSchedule"),)), True),
        (node("n", taints=(("cloud.google.com/impending-node-termination", "NoExecute"),)), True),
        (node("n", taints=(("karpenter.sh/disrupted", "NoSchedule"),)), True),
        (node("n", taints=(("aws-node-termination-handler/spot-itn", "NoSchedule"),)), True),
        # A soft hint is not a departure, nor is any other taint (the GPU one, say).
        (node("n", taints=(("DeletionCandidateOfClusterAutoscaler", "PreferNoSchedule"),)), False),
        (node("n", taints=(("nvidia.com/gpu", "NoSchedule"),)), False),
        (node("n", conditions=(("PreemptScheduled", "True"),)), True),
        (node("n", conditions=(("PreemptScheduled", "False"),)), False),
    ],
)
def test_which_nodes_are_leaving(body: dict[str, Any], leaving: bool) -> None:
    assert node_leaving(body) is leaving


def test_endpoints_on_a_leaving_node_leave_the_routes_before_the_pod_stops() -> None:
    source = KubeSource()
    source.on_model(None, model())
    where = {"10.0.0.1": "a", "10.0.0.2": "b"}
    source.on_slice(
        None, on_nodes(endpoint_slice("s", "m", ("10.0.0.1", True, False), ("10.0.0.2", True, False)), where)
    )
    assert source.on_node(None, node("a")) is False
    assert source.routed()[0].endpoints == (("10.0.0.1", 8000), ("10.0.0.2", 8000))
    # `a` is drained: its replica still reads ready in the slice, but is no longer routed.
    assert source.on_node("MODIFIED", node("a", unschedulable=True)) is True
    assert source.routed()[0].endpoints == (("10.0.0.2", 8000),)
    assert source.on_node("MODIFIED", node("a", unschedulable=True)) is False  # no change, no publish
    # Both nodes leaving: better the draining replicas than none while replacements start.
    source.on_node("MODIFIED", node("b", taints=(("ToBeDeletedByClusterAutoscaler", "NoSchedule"),)))
    assert source.routed()[0].endpoints == (("10.0.0.1", 8000), ("10.0.0.2", 8000))
    # Uncordoned, or gone from the API: routed as before.
    assert source.on_node("MODIFIED", node("b")) is True
    assert source.on_node("DELETED", node("a", unschedulable=True)) is True
    assert source.routed()[0].endpoints == (("10.0.0.1", 8000), ("10.0.0.2", 8000))


def lora(name: str, base: str, created: str, namespace: str = "ns", **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": namespace, "creationTimestamp": created, "generation": 1},
        "spec": {"baseModel": base, "source": f"file:///weights/{name}.gguf", **spec},
        "status": {"ready": "False"},
    }


def test_a_bases_adapters_travel_in_its_route_with_the_ids_its_pods_start_with() -> None:
    source = KubeSource()
    source.on_model(None, model("tiny", backend="llamacpp", source="file:///weights/tiny.gguf"))
    assert source.on_adapter(
        None, lora("sql", "tiny", "2026-12-01T10:00:00Z", servedName="tiny-sql", aliases=["sql-v1"], scale=0.5)
    )
    assert source.on_adapter(None, lora("poet", "tiny", "2026-12-01T10:00:05Z"))
    assert source.on_adapter(None, lora("stray", "nothing", "2026-12-01T10:00:00Z"))
    assert source.on_adapter(None, lora("elsewhere", "tiny", "2026-12-01T10:00:00Z", namespace="other"))
    (routed,) = source.routed()
    assert [(a.name, a.names, a.served_name, a.lora_id, a.scale) for a in routed.adapters] == [
        ("sql", ("sql", "tiny-sql", "sql-v1"), "tiny-sql", 0, 0.5),
        ("poet", ("poet",), "poet", 1, 1.0),
    ]
    # A status write changes nothing a route shows: no new snapshot for it.
    written = lora("sql", "tiny", "2026-12-01T10:00:00Z", servedName="tiny-sql", aliases=["sql-v1"], scale=0.5)
    written["status"] = {"ready": "True", "loadedReplicas": 1}
    assert not source.on_adapter("MODIFIED", written)
    assert source.on_adapter("DELETED", lora("sql", "tiny", ""))
    (routed,) = source.routed()
    assert [(a.name, a.lora_id) for a in routed.adapters] == [("poet", 0)]


def test_vllm_adapters_are_routed_by_name_and_refused_ones_not_at_all() -> None:
    source = KubeSource()
    source.on_model(None, model("chat", adapters={"maxAdapters": 1}))
    source.on_adapter(None, lora("a", "chat", "2026-12-01T10:00:00Z", source="hf://org/a"))
    source.on_adapter(None, lora("b", "chat", "2026-12-01T10:00:01Z", source="hf://org/b"))
    (routed,) = source.routed()
    assert [(a.name, a.lora_id) for a in routed.adapters] == [("a", -1)]


def test_a_change_rebuilds_only_the_models_it_touched(monkeypatch: pytest.MonkeyPatch) -> None:
    from wakegate.control.feeder import kube_source

    parsed: list[str] = []
    real = kube_source.model_from_object

    def counting(body: Any) -> Any:
        parsed.append(body["metadata"]["name"])
        return real(body)

    monkeypatch.setattr(kube_source, "model_from_object", counting)
    source = KubeSource()
    for i in range(200):
        source.on_model(None, model(f"m{i}"))
    first = {m.key: m for m in source.routed()}
    assert len(first) == 200 and len(parsed) == 200

    # A replica of one Model becomes ready: that Model alone is looked at again, and every
    # other RoutedModel is the very object of the last call (the feeder's build reuses them).
    parsed.clear()
    source.on_slice(None, endpoint_slice("s", "m7", ("10.0.0.7", True, False)))
    again = {m.key: m for m in source.routed()}
    assert parsed == []  # the manifest did not change: not even parsed again
    assert again["ns/m7"].endpoints == (("10.0.0.7", 8000),)
    assert all(again[k] is first[k] for k in first if k != "ns/m7")

    # The operator writes a Model's status: routed again (admission, failures), not parsed again.
    source.on_model(None, model("m9", phase="Failed", admitted=False))
    assert [m.admitted for m in source.routed() if m.key == "ns/m9"] == [False] and parsed == []

    # The Model's spec changes (the API server moves its generation): parsed again, alone.
    changed = model("m8", aliases=["eight"])
    changed["metadata"]["generation"] = 5
    source.on_model(None, changed)
    assert [m.names for m in source.routed() if m.key == "ns/m8"] == [("m8", "eight")] and parsed == ["m8"]

    # A node starts leaving: any Model may have endpoints there, so all are looked at (not parsed).
    assert source.on_node(None, {"metadata": {"name": "n1"}, "spec": {"unschedulable": True}})
    assert len(source.routed()) == 200 and parsed == ["m8"]


def test_the_feeder_knows_when_its_watches_hold_what_the_cluster_listed() -> None:
    """`wakegate xds` serves ADS only once its watches delivered every Model, backend slice and
    adapter a plain list found: a feeder restarted in an apiserver outage served an empty route
    table over the gateways' working one (e2e/test_chaos.py)."""
    adapter = {"metadata": {"name": "a", "namespace": "ns"}, "spec": {"baseModel": "m", "source": "file:///a"}}
    stranger = {"metadata": {"name": "other", "namespace": "ns", "labels": {}}}  # no Model's slice
    listed = Listed.of([model()], [endpoint_slice("s", "m", ("10.0.0.1", True, False)), stranger], [adapter])
    assert listed.slices == {("ns/m", "s")}
    source = KubeSource()
    assert not source.holds(listed)
    source.on_model(None, model())
    source.on_slice(None, endpoint_slice("s", "m", ("10.0.0.1", True, False)))
    assert not source.holds(listed)  # the adapter is still missing
    source.on_adapter(None, adapter)
    assert source.holds(listed)
    source.on_model(None, model("n"))  # more than listed (made since): still synced
    assert source.holds(listed)
    assert KubeSource().holds(Listed.of([], [], []))
