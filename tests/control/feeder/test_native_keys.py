"""API keys on the native routes in the pure snapshot builder: what Envoy's api_key_auth is given,
where, and that a rotation changes the route table only (docs/decisions.md, "The native path")."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from google.protobuf import json_format

from tests.control.feeder.test_native import DECIDED, NATIVE, native_routes
from wakegate.control.feeder import resources as r
from wakegate.control.feeder.envoy_types import LISTENER, LISTENER_NAME, ROUTE, ROUTE_NAME
from wakegate.control.feeder.keys import API_KEY_AUTH, BEARER_KEY
from wakegate.control.feeder.listeners import JSON_TO_METADATA, listener
from wakegate.control.feeder.ratelimit import LOCAL_RATE_LIMIT, RATE_LIMIT_METADATA
from wakegate.control.feeder.replies import LOCAL_REPLY_CONFIG
from wakegate.control.feeder.settings import GatewaySettings, gateway_keys
from wakegate.keyfile import ALL_MODELS, Scope, parse_entries

KEYED = GatewaySettings(native_allowed=True, key_checks=True)
OTHER = replace(NATIVE, key="ns/o", names=("o",), served_name="o", endpoints=(("127.0.0.1", 9101),))
KEYS = gateway_keys(
    [
        ("sk-wide-0123", ALL_MODELS),
        ("sk-by-key-4567", Scope(frozenset({"ns/n"}))),
        ("sk-by-name-89ab", Scope(frozenset({"o"}))),
        ("sk-by-alias-cdef", Scope(frozenset({"n-alias"}))),
    ]
)


def as_dict(message: Any) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)  # type: ignore[no-any-return]


def http_filters(built: r.Resources) -> list[dict[str, Any]]:
    hcm = as_dict(built.by_type[LISTENER][LISTENER_NAME])["filter_chains"][0]["filters"][0]["typed_config"]
    return list(hcm["http_filters"])


def mappers(built: r.Resources) -> list[dict[str, Any]]:
    hcm = as_dict(built.by_type[LISTENER][LISTENER_NAME])["filter_chains"][0]["filters"][0]["typed_config"]
    return list(hcm["local_reply_config"]["mappers"])


def key_check(route: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = route["typed_per_filter_config"][API_KEY_AUTH]
    return config


def test_each_native_route_checks_every_key_and_allows_the_clients_whose_scope_has_its_model() -> None:
    built = r.build([NATIVE, OTHER, DECIDED], KEYED, keys=KEYS)
    mine = native_routes(built)
    assert {x["route"]["cluster"] for x in mine} == {NATIVE.cluster, OTHER.cluster}
    for route in mine:
        check = key_check(route)
        assert check["credentials"] == [{"key": k.key, "client": k.client} for k in KEYS]
        assert check["key_sources"] == [{"header": "authorization"}]
        assert check["forwarding"] == {"hide_credentials": True}
        # extproc's rule: by the model's key or its own name; an alias is no scope entry.
        expected = ["k0", "k1"] if route["route"]["cluster"] == NATIVE.cluster else ["k0", "k2"]
        assert check["allowed_clients"] == expected, route["name"]
        # Only the Bearer form both paths read alike; any other goes to extproc.
        assert {"name": "authorization", "string_match": {"safe_regex": {"regex": r"Bearer \S+"}}} in route["match"][
            "headers"
        ]
    # Each route is named after the name it matches (the 404's text): header, path and body routes.
    assert sorted(x["name"] for x in mine if x["route"]["cluster"] == NATIVE.cluster) == [
        "n",
        "n",
        "n",
        "n-alias",
        "n-alias",
    ]


def test_the_listener_checks_keys_between_body_reading_and_extproc_and_words_its_refusals() -> None:
    built = r.build([NATIVE, DECIDED], KEYED, keys=KEYS)
    names = [f["name"] for f in http_filters(built)]
    assert names[:3] == [JSON_TO_METADATA, API_KEY_AUTH, "envoy.filters.http.ext_proc"]
    auth = http_filters(built)[1]
    assert auth["disabled"] is True  # on only where a native route turns it on
    # The listener holds no key: rotation must not touch it.
    assert "sk-" not in str(built.by_type[LISTENER][LISTENER_NAME])
    first, unknown, out_of_scope, *_ = mappers(built)
    assert first == LOCAL_REPLY_CONFIG["mappers"][0]
    assert unknown["body_format_override"]["json_format"]["error"] == {
        "message": "missing or invalid API key",
        "type": "authentication_error",
        "code": "invalid_api_key",
    }
    assert out_of_scope["status_code"] == 404
    assert out_of_scope["body_format_override"]["json_format"]["error"] == {
        "message": "model '%ROUTE_NAME%' does not exist",
        "type": "not_found_error",
        "code": "model_not_found",
    }


def test_a_rotation_changes_the_route_table_and_never_the_listener() -> None:
    before = r.build([NATIVE, DECIDED], KEYED, keys=KEYS)
    rotated = r.build([NATIVE, DECIDED], KEYED, keys=gateway_keys([("sk-new-key-0000", ALL_MODELS)]))
    assert rotated.by_type[LISTENER] == before.by_type[LISTENER]
    assert rotated.by_type[ROUTE] != before.by_type[ROUTE]
    assert "sk-new-key-0000" in str(rotated.by_type[ROUTE][ROUTE_NAME])
    assert "sk-wide-0123" not in str(rotated.by_type[ROUTE][ROUTE_NAME])


def test_a_model_no_key_may_use_allows_no_client_and_an_empty_file_no_key() -> None:
    nobody = gateway_keys([("sk-only-o-1111", Scope(frozenset({"o"})))])
    (route, *_) = native_routes(r.build([NATIVE], KEYED, keys=nobody))
    # An empty list would allow every known key.
    assert key_check(route)["allowed_clients"] == ["-"]
    (route, *_) = native_routes(r.build([NATIVE], KEYED, keys=()))
    assert "credentials" not in key_check(route)  # Envoy refuses every key: an empty file's meaning


def test_without_key_checks_nothing_of_api_key_auth_anywhere() -> None:
    open_gateway = GatewaySettings(native_allowed=True)
    built = r.build([NATIVE, DECIDED], open_gateway, keys=KEYS)
    assert native_routes(built)
    assert API_KEY_AUTH not in str(built.by_type[LISTENER][LISTENER_NAME])
    assert API_KEY_AUTH not in str(built.by_type[ROUTE][ROUTE_NAME])
    assert (
        mappers(built)
        == as_dict(listener(open_gateway, native=True))["filter_chains"][0]["filters"][0]["typed_config"][
            "local_reply_config"
        ]["mappers"]
    )
    # A gateway of decided models keeps its exact listener, keys or not.
    decided = r.build([replace(NATIVE, path="decided"), DECIDED], KEYED, keys=KEYS)
    assert decided.by_type[LISTENER][LISTENER_NAME] == listener(GatewaySettings())
    assert "sk-" not in str(decided.by_type[ROUTE][ROUTE_NAME])


def test_a_name_envoy_cannot_word_as_extproc_stays_decided_with_keys() -> None:
    quoted = replace(NATIVE, names=("n", "it's"))
    keyed = {x["name"] for x in native_routes(r.build([quoted], KEYED, keys=KEYS))}
    assert keyed == {"n"}
    unkeyed = {x["name"] for x in native_routes(r.build([quoted], GatewaySettings(native_allowed=True)))}
    assert unkeyed == {"n", "it's"}


def test_a_gated_view_keeps_the_keys() -> None:
    cluster = NATIVE.cluster
    base = r.build([NATIVE, OTHER], KEYED, keys=KEYS)
    waiting = r.for_gateway(base, [NATIVE, OTHER], {cluster: frozenset()}, None, KEYED, None, KEYS)
    mine = native_routes(waiting)
    assert {x["route"]["cluster"] for x in mine} == {OTHER.cluster}
    assert all(key_check(x)["credentials"] for x in mine)


def test_keys_come_from_the_file_parser_in_order_and_never_show_in_a_repr() -> None:
    entries, bad = parse_entries("sk-a-0000\nsk-b-1111 n, o\nbad , \nsk-a-0000 o\n", str)
    assert bad == [3]
    keys = gateway_keys(entries)
    assert [(k.client, k.key, k.scope) for k in keys] == [
        ("k0", "sk-a-0000", ALL_MODELS),
        ("k1", "sk-b-1111", Scope(frozenset({"n", "o"}))),
    ]
    assert "sk-" not in repr(keys)


def test_body_named_requests_in_bearer_form_meet_api_key_auth_from_their_first_route() -> None:
    """Envoy makes a request's filters from its first route, before the body names the model: a
    POST in the Bearer form first matches a catch-all that checks any key, and only then the
    native body route, which checks its model's scope."""
    table = as_dict(r.build([NATIVE, DECIDED], KEYED, keys=KEYS).by_type[ROUTE][ROUTE_NAME])
    routes = table["virtual_hosts"][0]["routes"]
    bearer, catch_all = routes[-2:]
    assert catch_all["match"] == {"prefix": "/"}
    assert JSON_TO_METADATA not in catch_all["typed_per_filter_config"] and API_KEY_AUTH not in str(catch_all)
    assert bearer["match"]["prefix"] == "/" and "direct_response" in bearer
    assert {"name": "authorization", "string_match": {"safe_regex": {"regex": r"Bearer \S+"}}} in bearer["match"][
        "headers"
    ]
    check = key_check(bearer)
    assert check["credentials"] == [{"key": k.key, "client": k.client} for k in KEYS]
    # Any key passes here, and extproc still sees it: the scope is its to check.
    assert "allowed_clients" not in check and "forwarding" not in check
    # No body route (a cold native model), no such catch-all.
    cold = r.build([replace(NATIVE, endpoints=()), DECIDED], KEYED, keys=KEYS)
    assert API_KEY_AUTH not in str(cold.by_type[ROUTE][ROUTE_NAME])


def test_with_keys_and_a_rate_limit_a_key_is_checked_before_the_bucket_on_every_route_that_draws() -> None:
    """A request refused for its key must spend no token: the key check sits before the local rate
    limit in the chain, and every decided route that draws from a bucket (a cold model's names, a
    warm one's aliases in the body) checks the key and its scope first, in the Bearer form only,
    and keeps the key on the request for extproc's own check."""
    limited = replace(NATIVE, requests_per_second=2.0, burst=3.0)
    for model in (limited, replace(limited, endpoints=())):  # warm, then cold
        built = r.build([model, DECIDED], KEYED, keys=KEYS)
        names = [f["name"] for f in http_filters(built)]
        extproc = names.index("envoy.filters.http.ext_proc")
        assert names.index(API_KEY_AUTH) < names.index(LOCAL_RATE_LIMIT) < extproc
        table = as_dict(built.by_type[ROUTE][ROUTE_NAME])["virtual_hosts"][0]["routes"]
        drawing = [x for x in table if RATE_LIMIT_METADATA in x.get("metadata", {}).get("filter_metadata", {})]
        counted = [x for x in drawing if "direct_response" in x]
        assert counted, table
        for route in counted:
            check = key_check(route)
            assert "forwarding" not in check  # extproc still gets the key
            assert sorted(check["allowed_clients"]) == ["k0", "k1"]  # wide, by key (an alias is no scope entry)
            assert BEARER_KEY in route["match"]["headers"]
            assert route["name"] in model.names  # the 404 of an out-of-scope key names what was asked
            assert route["typed_per_filter_config"]["envoy.filters.http.ext_proc"].get("disabled") is None
        mappers_ = [m.get("filter", {}).get("status_code_filter", {}) for m in mappers(built)]
        codes = [int(m["comparison"]["value"]["default_value"]) for m in mappers_ if m]
        assert 401 in codes and 429 in codes
        # api_key_auth's 403 is told from Envoy's other 403s (an upgrade refused) by its details.
        cel = [m.get("filter", {}).get("extension_filter", {}).get("typed_config", {}) for m in mappers(built)]
        assert "response.code_details == 'client_not_allowed'" in {c.get("expression") for c in cel}
        assert 403 not in codes
