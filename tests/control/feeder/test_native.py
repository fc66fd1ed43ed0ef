"""The native path in the pure snapshot builder: which models Envoy routes alone, and the
ACK-ordered switch between the native and the decided path (docs/architecture.md)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from google.protobuf import json_format

from wakegate import contract
from wakegate.control.feeder import listeners
from wakegate.control.feeder import resources as r
from wakegate.control.feeder.clusters import envoy_always_picks
from wakegate.control.feeder.envoy_types import (
    CLUSTER,
    ENDPOINT,
    LISTENER,
    LISTENER_NAME,
    MODEL_ROUTE,
    ROUTE,
    ROUTE_NAME,
)
from wakegate.control.feeder.listeners import JSON_TO_METADATA
from wakegate.control.feeder.native import native_blocker, native_keys
from wakegate.control.feeder.routed import RoutedModel, routed_model
from wakegate.control.feeder.routes import natively_routed
from wakegate.control.feeder.settings import GatewaySettings

ON = GatewaySettings(native_allowed=True)
EP = ("127.0.0.1", 9100)
NATIVE = RoutedModel(
    key="ns/n",
    names=("n", "n-alias"),
    served_name="n",
    strategy="round-robin",
    path="native",
    endpoints=(EP,),
)
DECIDED = RoutedModel(key="d", names=("d",), served_name="d", endpoints=(("127.0.0.1", 9200),))


def routes(built: r.Resources) -> list[dict[str, Any]]:
    config = json_format.MessageToDict(built.by_type[ROUTE][ROUTE_NAME], preserving_proto_field_name=True)
    return list(config["virtual_hosts"][0]["routes"])


def native_routes(built: r.Resources) -> list[dict[str, Any]]:
    # The park route (a cold request waiting at an extproc) is not a model's.
    return [x for x in routes(built) if x.get("route", {}).get("cluster") not in (None, contract.EXTPROC_CLUSTER)]


def endpoints(built: r.Resources, cluster: str) -> set[tuple[str, int]]:
    cla = built.by_type[ENDPOINT][cluster]
    return {
        (lb.endpoint.address.socket_address.address, lb.endpoint.address.socket_address.port_value)  # type: ignore[attr-defined]
        for locality in cla.endpoints  # type: ignore[attr-defined]
        for lb in locality.lb_endpoints
    }


@pytest.mark.parametrize(
    ("change", "settings", "reason"),
    [
        ({"path": "decided"}, ON, "routing.path is decided"),
        ({}, GatewaySettings(), "the gateway's native path is off (API keys or a global rate limit on the cluster)"),
        ({"strategy": "default", "profile": "balanced"}, ON, "scored or sticky picking"),
        ({"strategy": "session-affinity"}, ON, "scored or sticky picking"),
        ({"lora_adapters": ("sql",)}, ON, "LoRA adapters"),
        ({"requests_per_second": 5.0}, replace(ON, global_rate_limit=True), "a gateway-wide rate limit"),
        ({"admitted": False}, ON, "waiting for its GPU group"),
        ({"endpoints": ()}, ON, "no ready endpoint"),
    ],
)
def test_what_keeps_a_model_on_the_decided_path(
    change: dict[str, Any], settings: GatewaySettings, reason: str
) -> None:
    model = replace(NATIVE, **change)
    assert native_blocker(model, settings).startswith(reason)
    built = r.build([model, DECIDED], settings)
    assert native_routes(built) == []
    assert natively_routed(built.by_type[ROUTE][ROUTE_NAME]) == frozenset()


def test_a_least_loaded_model_goes_native_with_envoys_full_scan_least_request() -> None:
    """Envoy's own pick for a native least-loaded model compares every endpoint's active requests
    (not two sampled ones), as extproc compares its in-flight counts."""
    model = replace(NATIVE, strategy="least-loaded", endpoints=(EP, ("127.0.0.1", 9101), ("127.0.0.1", 9102)))
    assert native_blocker(model, ON) == ""
    built = r.build([model, DECIDED], ON)
    assert {x["route"]["cluster"] for x in native_routes(built)} == {model.cluster}
    cluster = json_format.MessageToDict(built.by_type[CLUSTER][model.cluster], preserving_proto_field_name=True)
    (policy,) = cluster["load_balancing_policy"]["policies"]
    override = policy["typed_extension_config"]["typed_config"]
    (fallback,) = override["fallback_policy"]["policies"]
    assert fallback["typed_extension_config"]["name"] == "envoy.load_balancing_policies.least_request"
    assert fallback["typed_extension_config"]["typed_config"]["selection_method"] == "FULL_SCAN"
    # A round-robin model keeps round robin.
    rr = json_format.MessageToDict(built.by_type[CLUSTER][DECIDED.cluster], preserving_proto_field_name=True)
    (rr_policy,) = rr["load_balancing_policy"]["policies"]
    (rr_fallback,) = rr_policy["typed_extension_config"]["typed_config"]["fallback_policy"]["policies"]
    assert rr_fallback["typed_extension_config"]["name"] == "envoy.load_balancing_policies.round_robin"


def lb_policies(built: r.Resources, cluster: str) -> list[str]:
    """The names of a cluster's load-balancing policies, outermost first."""
    config = json_format.MessageToDict(built.by_type[CLUSTER][cluster], preserving_proto_field_name=True)
    names = []
    policies = config["load_balancing_policy"]["policies"]
    while policies:
        (policy,) = policies
        names.append(policy["typed_extension_config"]["name"])
        policies = policy["typed_extension_config"]["typed_config"].get("fallback_policy", {}).get("policies")
    return names


@pytest.mark.parametrize("path", ["native", "decided"])
def test_a_model_extproc_never_picks_for_has_no_override_host(path: str) -> None:
    """Round robin without scoring or adapters: extproc names no endpoint on either path, so its
    cluster is Envoy's round robin alone, the same whether it is native or decided now."""
    model = replace(NATIVE, path=path)
    assert envoy_always_picks(model)
    built = r.build([model, DECIDED], ON)
    assert lb_policies(built, model.cluster) == ["envoy.load_balancing_policies.round_robin"]
    cold = r.build([replace(model, endpoints=())], ON)
    assert lb_policies(cold, model.cluster) == lb_policies(built, model.cluster)  # no cluster change on the switch
    # Everything extproc may pick an endpoint for keeps the override.
    for picked in (
        DECIDED,
        replace(model, strategy="least-loaded"),
        replace(model, profile="balanced"),
        replace(model, lora_adapters=("sql",)),
        replace(model, adapters_on_demand=True),
    ):
        assert not envoy_always_picks(picked)
        assert lb_policies(r.build([picked], ON), picked.cluster)[0] == "envoy.load_balancing_policies.override_host"


def test_a_default_model_stays_on_balanced_picking_even_when_it_asks_for_native() -> None:
    from wakegate.control.manifests import parse_models

    (model,) = parse_models(
        "apiVersion: wakegate.io/v1alpha1\nkind: Model\nmetadata: {name: m}\nspec:\n  backend: sim\n"
        "  routing: {path: native}\n"
    )
    routed = routed_model(model, [EP])
    assert routed.profile == "balanced"
    assert "picking" in native_blocker(routed, ON)


def test_a_gateway_of_decided_models_has_the_listener_and_routes_it_always_had() -> None:
    decided = [replace(NATIVE, path="decided"), DECIDED]
    built = r.build(decided, ON)
    assert built.by_type[LISTENER][LISTENER_NAME] == listeners.listener(ON)
    assert JSON_TO_METADATA not in str(built.by_type[LISTENER][LISTENER_NAME])
    assert JSON_TO_METADATA not in str(built.by_type[ROUTE][ROUTE_NAME])
    assert native_routes(built) == []
    # No API keys allowed it, but keys on the gateway make the same ask decided-only too.
    keyed = r.build([NATIVE, DECIDED], GatewaySettings())
    assert keyed.by_type[LISTENER][LISTENER_NAME] == listeners.listener(GatewaySettings())


def test_a_cold_native_model_reads_no_body_but_keeps_the_listener_it_will_need() -> None:
    cold = r.build([replace(NATIVE, endpoints=()), DECIDED], ON)
    warm = r.build([NATIVE, DECIDED], ON)
    # Waking changes routes only: a listener update would drain every connection.
    assert cold.by_type[LISTENER] == warm.by_type[LISTENER]
    for route in routes(cold):
        assert route["typed_per_filter_config"][JSON_TO_METADATA]["disabled"] is True, route
    assert native_routes(cold) == []


def test_native_routes_by_header_path_and_body_skip_extproc_and_mark_the_request() -> None:
    built = r.build([NATIVE, DECIDED], ON)
    table = routes(built)
    mine = native_routes(built)
    assert {x["route"]["cluster"] for x in mine} == {"model.ns.n"}
    for route in mine:
        # Extproc is off by default in this listener: a route a request meets first names no
        # config of it (any would create the filter), a body route (met second) switches it off.
        body_route = "dynamic_metadata" in route["match"]
        extproc = route["typed_per_filter_config"].get("envoy.filters.http.ext_proc")
        assert extproc == ({"@type": extproc["@type"], "disabled": True} if body_route else None), route
        assert route["request_headers_to_add"][0]["header"] == {"key": contract.NATIVE_HEADER, "value": "1"}
        assert {"name": ":method", "string_match": {"exact": "POST"}} in route["match"]["headers"]
    by_header = [
        x
        for x in mine
        if any(h["name"] == contract.MODEL_HEADER and "string_match" in h for h in x["match"]["headers"])
    ]
    assert sorted(
        h["string_match"]["exact"]
        for x in by_header
        for h in x["match"]["headers"]
        if h["name"] == contract.MODEL_HEADER
    ) == ["n", "n-alias"]
    by_path = [x for x in mine if x["match"]["prefix"].startswith(contract.MODEL_PATH_PREFIX)]
    assert sorted(x["match"]["prefix"] for x in by_path) == ["/model/n-alias/", "/model/n/"]
    assert all(x["route"]["prefix_rewrite"] == "/" for x in by_path)
    # The body names only the served name natively: an alias in the body needs extproc's rewrite.
    by_body = [x for x in mine if "dynamic_metadata" in x["match"]]
    (body,) = by_body
    assert body["match"]["dynamic_metadata"][0]["filter"] == contract.NATIVE_METADATA_NAMESPACE
    assert body["match"]["dynamic_metadata"][0]["value"]["string_match"]["exact"] == "n"
    # Header beats path beats body, as in extproc: each kind sits right before its decided twin.
    order = [table.index(x) for x in (by_header[0], by_path[0], body)]
    header_any = next(i for i, x in enumerate(table) if "safe_regex" in str(x["match"].get("headers", "")))
    path_any = next(i for i, x in enumerate(table) if x["match"].get("prefix") == contract.MODEL_PATH_PREFIX)
    assert order[0] < header_any < order[1] < path_any < order[2] < len(table) - 1
    # The catch-all reads the body's model into metadata now.
    assert JSON_TO_METADATA not in table[-1]["typed_per_filter_config"]
    # Extproc is off in this listener unless a route turns it on: every route but the native
    # ones does (the cluster_header one too: a request meeting it skips no check). A native
    # route names no extproc config at all: even a disabling one would make Envoy create it.
    for route in table:
        config = route.get("typed_per_filter_config", {}).get("envoy.filters.http.ext_proc")
        if route not in mine:
            assert config is not None and "disabled" not in config, route


def test_extproc_is_created_only_for_requests_a_route_gives_it() -> None:
    """With native routes possible, the listener's extproc is off by default (a native request
    then costs Envoy no extproc filter at all) and a client's cluster header is dropped before
    any route is matched; a gateway of decided models keeps extproc on for every request."""
    for native, disabled in ((True, True), (False, False)):
        listener = json_format.MessageToDict(listeners.listener(ON, native=native), preserving_proto_field_name=True)
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        (extproc,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
        assert extproc.get("disabled", False) is disabled
        mutations = hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
        assert ({"remove": contract.CLUSTER_HEADER} in mutations) is native


def test_the_listener_hides_native_requests_from_extproc_and_drops_a_clients_mark() -> None:
    listener = json_format.MessageToDict(listeners.listener(ON, native=True), preserving_proto_field_name=True)
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["http_filters"][0]["name"] == JSON_TO_METADATA
    mutations = hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    assert {"remove": contract.NATIVE_HEADER} in mutations
    assert {"remove": contract.DESTINATION_HEADER} in mutations
    for log in hcm["access_log"]:
        header = log["filter"]["header_filter"]["header"]
        assert header["name"] == contract.NATIVE_HEADER and header["invert_match"] is True


def test_a_model_goes_native_only_once_its_envoy_has_an_endpoint() -> None:
    cluster = NATIVE.cluster
    waiting = r.build([NATIVE, DECIDED], ON, confirmed={cluster: frozenset()})
    assert native_routes(waiting) == []
    arrived = r.build([NATIVE, DECIDED], ON, confirmed={cluster: frozenset({EP})})
    assert {x["route"]["cluster"] for x in native_routes(arrived)} == {cluster}


def test_the_last_endpoint_leaves_only_after_envoy_dropped_its_native_routes() -> None:
    cluster = NATIVE.cluster
    cold = replace(NATIVE, endpoints=())
    # Envoy still routes natively (its acknowledged routes): its endpoint stays, the routes go.
    switching = r.build([cold, DECIDED], ON, confirmed={cluster: frozenset({EP})}, routed_natively={cluster})
    assert native_routes(switching) == []
    assert endpoints(switching, cluster) == {EP}
    # extproc, which holds the model's requests from now on, sees no endpoint at all.
    assert list(switching.by_type[MODEL_ROUTE]["ns/n"].endpoints) == []  # type: ignore[attr-defined]
    # Envoy acknowledged the routes without native ones: the endpoint may go.
    switched = r.build([cold, DECIDED], ON, confirmed={cluster: frozenset({EP})}, routed_natively=frozenset())
    assert endpoints(switched, cluster) == set()


def test_a_draining_replica_leaves_a_native_model_at_once_while_another_serves() -> None:
    cluster = NATIVE.cluster
    other = ("127.0.0.1", 9101)
    two = replace(NATIVE, endpoints=(EP, other))
    one = replace(NATIVE, endpoints=(other,))
    view = r.build([one], ON, confirmed={cluster: frozenset({EP, other})}, routed_natively={cluster})
    assert endpoints(view, cluster) == {other}
    assert {x["route"]["cluster"] for x in native_routes(view)} == {cluster}
    assert native_keys([two], ON) == native_keys([one], ON) == {"ns/n"}
