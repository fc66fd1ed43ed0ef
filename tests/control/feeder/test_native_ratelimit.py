"""Per-model rate limits on the native path in the pure snapshot builder: the buckets in Envoy's
local rate limit, the routes that draw from them, and what extproc is told (docs/decisions.md,
"The native path"). The same config through the real Envoy and `up`: tests/gateway/test_native_ratelimit.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from envoy.type.v3 import token_bucket_pb2
from google.protobuf import json_format

from tests.control.feeder.test_native import DECIDED, NATIVE, ON
from tests.control.feeder.test_resources import assert_envoy_accepts
from wakegate import contract
from wakegate.control.feeder import listeners
from wakegate.control.feeder import resources as r
from wakegate.control.feeder.envoy_types import LISTENER, LISTENER_NAME, MODEL_ROUTE, ROUTE, ROUTE_NAME
from wakegate.control.feeder.listeners import JSON_TO_METADATA
from wakegate.control.feeder.native import may_go_native, native_blocker, native_keys
from wakegate.control.feeder.ratelimit import (
    HEADER_MUTATION,
    LOCAL_RATE_LIMIT,
    RATE_LIMIT_METADATA,
    envoy_rate_limited,
    refused_retry_after,
    token_bucket,
)
from wakegate.control.feeder.routed import RoutedModel
from wakegate.control.feeder.settings import GatewaySettings
from wakegate.extproc.ratelimit import retry_after_header
from wakegate.extproc.responses import error_body

LIMITED = replace(NATIVE, requests_per_second=2.5, burst=4)
MARK = {"key": contract.RATE_COUNTED_HEADER, "value": "ns/n"}


def as_dict(message: Any) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def hcm(built: r.Resources) -> dict[str, Any]:
    listener = as_dict(built.by_type[LISTENER][LISTENER_NAME])
    return dict(listener["filter_chains"][0]["filters"][0]["typed_config"])


#: The listener's filters up to ext_proc where Envoy keeps buckets: the body read, then the bucket.
BUCKET_FIRST = [JSON_TO_METADATA, LOCAL_RATE_LIMIT, HEADER_MUTATION, "envoy.filters.http.ext_proc"]


def filters_to_extproc(config: dict[str, Any]) -> list[str]:
    names = [f["name"] for f in config["http_filters"]]
    return names[: names.index("envoy.filters.http.ext_proc") + 1]


def routes(built: r.Resources) -> list[dict[str, Any]]:
    return list(as_dict(built.by_type[ROUTE][ROUTE_NAME])["virtual_hosts"][0]["routes"])


def drawn(route: dict[str, Any]) -> str | None:
    """The model whose bucket the route draws from, if any."""
    found = route.get("metadata", {}).get("filter_metadata", {}).get(RATE_LIMIT_METADATA, {})
    return found.get("model")


def named_by_header(route: dict[str, Any]) -> str | None:
    headers = route["match"].get("headers", [])
    named = (h["string_match"]["exact"] for h in headers if h["name"] == contract.MODEL_HEADER and "string_match" in h)
    return next(named, None)


def marks(route: dict[str, Any]) -> bool:
    mutation = route.get("typed_per_filter_config", {}).get(HEADER_MUTATION, {})
    return any(m["append"]["header"] == MARK for m in mutation.get("mutations", {}).get("request_mutations", []))


def marked(route: dict[str, Any]) -> str | None:
    """The model a route tells extproc Envoy counted, if any."""
    mutation = route.get("typed_per_filter_config", {}).get(HEADER_MUTATION, {})
    for m in mutation.get("mutations", {}).get("request_mutations", []):
        if m["append"]["header"]["key"] == contract.RATE_COUNTED_HEADER:
            return str(m["append"]["header"]["value"])
    return None


@pytest.mark.parametrize(
    ("rate", "burst"), [(0.5, 2), (1.0, 0), (2.5, 4), (100.0, 10), (1 / 3, 1), (1000.7, 0), (0.001, 3.9)]
)
def test_envoys_bucket_is_extprocs_to_the_millisecond(rate: float, burst: float) -> None:
    bucket = json_format.ParseDict(token_bucket(rate, burst), token_bucket_pb2.TokenBucket())
    interval = bucket.fill_interval.ToMilliseconds()
    assert interval >= 50  # Envoy refuses shorter intervals
    assert bucket.tokens_per_fill.value / (interval / 1000) == pytest.approx(rate, rel=5e-4)
    # extproc's burst: `burst`, or max(1, rate) for 0; Envoy's is whole, never larger.
    wanted = burst or max(1.0, rate)
    assert bucket.max_tokens == max(1, math.floor(wanted)) <= wanted


def test_an_absurd_rate_still_gives_a_bucket_envoy_takes() -> None:
    bucket = json_format.ParseDict(token_bucket(1e12, 1e12), token_bucket_pb2.TokenBucket())
    assert bucket.fill_interval.ToMilliseconds() >= 50
    assert bucket.max_tokens == bucket.tokens_per_fill.value == 2**32 - 1


@pytest.mark.parametrize("rate", [0.1, 0.3, 1 / 3, 0.5, 0.75, 1.0, 2.5, 50.0])
def test_envoys_retry_after_is_extprocs_longest_wait(rate: float) -> None:
    # extproc answers ceil of the wait for one token, which is at most 1 / rate (an empty bucket).
    assert refused_retry_after(rate) == retry_after_header(1 / rate)
    if rate >= 1:
        assert refused_retry_after(rate) == "1"  # the only answer extproc gives at such rates


def test_a_limited_native_model_has_its_bucket_in_the_listener_before_extproc() -> None:
    built = r.build([LIMITED, DECIDED], ON)
    config = hcm(built)
    assert filters_to_extproc(config) == BUCKET_FIRST
    limit = config["http_filters"][1]["typed_config"]
    assert limit["filter_enabled"] == limit["filter_enforced"]
    assert limit["filter_enforced"]["default_value"] == {"numerator": 100}
    assert "token_bucket" not in limit and limit["always_consume_default_token_bucket"] is False
    # One bucket, for the model with a limit; the unlimited model has none.
    (descriptor,) = limit["descriptors"]
    assert descriptor["entries"][0]["value"] == "ns/n"
    assert descriptor["token_bucket"] == as_dict(
        json_format.ParseDict(token_bucket(2.5, 4), token_bucket_pb2.TokenBucket())
    )
    (action,) = limit["rate_limits"][0]["actions"]
    assert action["metadata"]["source"] == "ROUTE_ENTRY"
    assert action["metadata"]["metadata_key"]["key"] == RATE_LIMIT_METADATA
    # A client cannot claim its request was counted.
    mutations = config["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    assert {"remove": contract.RATE_COUNTED_HEADER} in mutations
    # Envoy's 429 in extproc's shape, right after extproc's own replies pass through.
    refused = config["local_reply_config"]["mappers"][1]
    assert refused["filter"]["status_code_filter"]["comparison"]["value"]["default_value"] == 429
    assert json.loads(error_body(429, "rate_limited", "rate limit exceeded; retry later")) == {
        "error": refused["body_format_override"]["json_format"]["error"]
    }
    assert built.by_type[MODEL_ROUTE]["ns/n"].rate_limit.counted_by_envoy is True  # type: ignore[attr-defined]
    assert built.by_type[MODEL_ROUTE]["d"].rate_limit.counted_by_envoy is False  # type: ignore[attr-defined]


def test_warm_every_native_route_and_the_aliases_in_the_body_draw_from_the_bucket() -> None:
    table = routes(r.build([LIMITED, DECIDED], ON))
    native = [x for x in table if x.get("route", {}).get("cluster") not in (None, contract.EXTPROC_CLUSTER)]
    assert native and {drawn(x) for x in native} == {"ns/n"}
    assert not any(marks(x) for x in native)  # extproc never sees these
    # Decided: only the alias in the body (the native routes take every other way of naming it).
    counted = [x for x in table if drawn(x) and "direct_response" in x]
    (alias,) = counted
    assert alias["match"]["dynamic_metadata"][0]["value"]["string_match"]["exact"] == "n-alias"
    assert marks(alias) and table.index(alias) == len(table) - 2
    # Buffered, as the catch-all: extproc on with no override of its mode.
    assert alias["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"] == {}
    assert alias["metadata"]["filter_metadata"][RATE_LIMIT_METADATA]["retry_after"] == "1"


def test_cold_every_name_every_way_draws_from_the_bucket_and_tells_extproc() -> None:
    table = routes(r.build([replace(LIMITED, endpoints=()), DECIDED], ON))
    assert not [x for x in table if x.get("route", {}).get("cluster") not in (None, contract.EXTPROC_CLUSTER)]
    counted = [x for x in table if drawn(x)]
    assert all(marks(x) and x["direct_response"]["status"] == 404 for x in counted)
    headers = sorted(named_by_header(x) for x in counted if named_by_header(x))
    paths = sorted(x["match"]["prefix"] for x in counted if x["match"]["prefix"] != "/")
    bodies = sorted(
        x["match"]["dynamic_metadata"][0]["value"]["string_match"]["exact"]
        for x in counted
        if "dynamic_metadata" in x["match"]
    )
    assert (headers, paths, bodies) == (["n", "n-alias"], ["/model/n-alias/", "/model/n/"], ["n", "n-alias"])
    for x in counted:  # POSTs only, as the native routes: other methods take their token in extproc
        assert {"name": ":method", "string_match": {"exact": "POST"}} in x["match"]["headers"]
    # Header beats path beats body: each kind sits before the decided route of the same kind.
    header_any = next(i for i, x in enumerate(table) if "safe_regex" in str(x["match"].get("headers", "")))
    path_any = next(i for i, x in enumerate(table) if x["match"].get("prefix") == contract.MODEL_PATH_PREFIX)
    for x in counted:
        at = table.index(x)
        if named_by_header(x):
            assert at < header_any
        elif x["match"]["prefix"] != "/":
            assert header_any < at < path_any
        else:
            assert path_any < at < len(table) - 1
    # The catch-all reads the body's `model` even with no model native now: the body routes need it.
    assert JSON_TO_METADATA not in table[-1].get("typed_per_filter_config", {})


@pytest.mark.parametrize(
    ("model", "settings"),
    [
        (LIMITED, GatewaySettings()),
        (replace(LIMITED, requests_per_second=0.0), ON),
        (replace(LIMITED, lora_adapters=("a",)), ON),
    ],
    ids=["keys", "unlimited", "adapters"],
)
def test_without_a_bucket_in_envoy_the_listener_and_extproc_are_as_before(
    model: RoutedModel, settings: GatewaySettings
) -> None:
    built = r.build([model, DECIDED], settings)
    assert envoy_rate_limited([model, DECIDED], settings) == ()
    assert built.by_type[LISTENER][LISTENER_NAME] == listeners.listener(settings, may_go_native([model], settings))
    assert LOCAL_RATE_LIMIT not in str(built.by_type[LISTENER][LISTENER_NAME])
    assert not any(drawn(x) for x in routes(built))
    assert built.by_type[MODEL_ROUTE]["ns/n"].rate_limit.counted_by_envoy is False  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("model", "settings"),
    [
        (replace(LIMITED, path="decided"), ON),
        (replace(LIMITED, strategy="prefix"), ON),
        (LIMITED, replace(ON, global_rate_limit=True)),
    ],
    ids=["decided", "scored", "global-limit"],
)
def test_a_limited_model_that_never_goes_native_draws_from_envoys_bucket_too(
    model: RoutedModel, settings: GatewaySettings
) -> None:
    """Whichever extproc Envoy sends a request to (the standby, at start-up or on a failover),
    the model's one bucket is Envoy's: every name, every way, the body read before extproc."""
    for fleet in ([model, DECIDED], [model]):  # with or without a model that asks for the native path
        built = r.build(fleet, settings)
        assert envoy_rate_limited(fleet, settings) == (model,)
        config = hcm(built)
        assert filters_to_extproc(config) == BUCKET_FIRST
        table = routes(built)
        assert not [x for x in table if x.get("route", {}).get("cluster") not in (None, contract.EXTPROC_CLUSTER)]
        counted = [x for x in table if drawn(x)]
        assert counted and all(marks(x) and drawn(x) == "ns/n" for x in counted)
        bodies = sorted(
            x["match"]["dynamic_metadata"][0]["value"]["string_match"]["exact"]
            for x in counted
            if "dynamic_metadata" in x["match"]
        )
        assert bodies == ["n", "n-alias"]
        # The catch-all reads the body's `model` for the body routes; extproc is on for it.
        assert JSON_TO_METADATA not in table[-1].get("typed_per_filter_config", {})
        assert "envoy.filters.http.ext_proc" in table[-1]["typed_per_filter_config"]
        assert built.by_type[MODEL_ROUTE]["ns/n"].rate_limit.counted_by_envoy is True  # type: ignore[attr-defined]


def test_a_global_limit_keeps_every_model_decided() -> None:
    settings = replace(ON, global_rate_limit=True)
    assert native_blocker(replace(LIMITED, requests_per_second=0.0), settings) == (
        "a gateway-wide rate limit (--global-rps)"
    )
    assert native_keys([LIMITED], settings) == frozenset()


def test_with_the_global_bucket_in_envoy_every_model_draws_from_it_and_extproc_is_told() -> None:
    settings = replace(ON, global_rate_limit=True, global_rps=0.5, global_burst=3)
    built = r.build([replace(LIMITED, path="decided"), DECIDED], settings)
    limit = next(f for f in hcm(built)["http_filters"] if f["name"] == LOCAL_RATE_LIMIT)["typed_config"]
    buckets = {d["entries"][0]["value"]: d["token_bucket"] for d in limit["descriptors"]}
    # One bucket per limited model, one gateway-wide; the unlimited model has none of its own.
    assert set(buckets) == {"ns/n", "all"} and buckets["all"]["max_tokens"] == 3
    for key in ("ns/n", "d"):
        table = [x for x in routes(built) if marked(x) == key]
        assert table and all(x["metadata"]["filter_metadata"][RATE_LIMIT_METADATA]["global"] for x in table)
        rate = built.by_type[MODEL_ROUTE][key].rate_limit  # type: ignore[attr-defined]
        assert rate.counted_by_envoy and rate.global_counted_by_envoy
    unlimited = next(x for x in routes(built) if marked(x) == "d")
    assert drawn(unlimited) is None  # the global bucket only
    # The slower bucket's wait: 1 / 0.5 s.
    assert unlimited["metadata"]["filter_metadata"][RATE_LIMIT_METADATA]["retry_after"] == "2"
    # Without it in Envoy (the chart's extproc keeps it), extproc is told nothing of a global token.
    plain = r.build([replace(LIMITED, path="decided")], replace(ON, global_rate_limit=True))
    assert not plain.by_type[MODEL_ROUTE]["ns/n"].rate_limit.global_counted_by_envoy  # type: ignore[attr-defined]


def test_waking_and_gating_keep_the_buckets_and_what_extproc_is_told() -> None:
    cold = r.build([replace(LIMITED, endpoints=()), DECIDED], ON)
    warm = r.build([LIMITED, DECIDED], ON)
    # The buckets live in the listener, which does not change when the model wakes (no drain).
    assert cold.by_type[LISTENER] == warm.by_type[LISTENER]
    # A gateway whose Envoy has not the endpoint yet: extproc's route is rebuilt, still counted.
    gated = r.build([LIMITED, DECIDED], ON, confirmed={LIMITED.cluster: frozenset()})
    route = gated.by_type[MODEL_ROUTE]["ns/n"]
    assert list(route.endpoints) == [] and route.rate_limit.counted_by_envoy is True  # type: ignore[attr-defined]
    assert any(drawn(x) and marks(x) for x in routes(gated))


def test_envoy_accepts_the_buckets_and_the_routes(tmp_path: Path) -> None:
    other = replace(LIMITED, key="c", names=("c", "c/with/slashes"), served_name="org/c", endpoints=())
    assert_envoy_accepts(r.build([LIMITED, other, DECIDED], ON), tmp_path)
    decided = replace(LIMITED, path="decided")
    assert_envoy_accepts(r.build([decided, DECIDED], replace(ON, global_rate_limit=True)), tmp_path)
    global_bucket = replace(ON, global_rate_limit=True, global_rps=0.5, global_burst=3)
    assert_envoy_accepts(r.build([decided, DECIDED], global_bucket), tmp_path)
