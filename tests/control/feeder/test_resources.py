"""The pure snapshot builder produces resources real Envoy accepts (checked by `envoy --mode validate`)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from google.protobuf import json_format

from tests.control.feeder.test_native import NATIVE
from wakegate import contract
from wakegate.control.feeder import resources as r
from wakegate.control.feeder.clusters import TLS_MATCH_KEY
from wakegate.control.feeder.envoy_types import (
    CLUSTER,
    ENDPOINT,
    LISTENER,
    LISTENER_NAME,
    MODEL_ROUTE,
    ROUTE,
    ROUTE_NAME,
)
from wakegate.control.feeder.model_routes import model_route
from wakegate.control.feeder.native import native_blocker
from wakegate.control.feeder.routed import (
    RoutedAdapter,
    RoutedFlow,
    RoutedModel,
    UpstreamTls,
    routed_flow,
    routed_model,
)
from wakegate.control.feeder.routes import natively_routed
from wakegate.control.feeder.settings import GatewaySettings, gateway_keys
from wakegate.keyfile import ALL_MODELS, Scope

MODELS = [
    RoutedModel(
        key="a",
        names=("a", "alias"),
        served_name="org/a",
        strategy="least-loaded",
        endpoints=(("127.0.0.1", 9001), ("127.0.0.1", 9000)),
    ),
    RoutedModel(key="ns/b", names=("b",), served_name="b", cold_mode="keepalive", max_queue=7),
]


def test_build_has_every_type_and_one_cluster_per_model() -> None:
    built = r.build(MODELS, GatewaySettings())
    assert set(built.by_type[CLUSTER]) == {"model.a", "model.ns.b"}
    assert set(built.by_type[MODEL_ROUTE]) == {"a", "ns/b"}
    cla = built.by_type[ENDPOINT]["model.a"]
    ports = [e.endpoint.address.socket_address.port_value for e in cla.endpoints[0].lb_endpoints]  # type: ignore[attr-defined]
    assert ports == [9000, 9001]
    route = built.by_type[MODEL_ROUTE]["ns/b"]
    assert route.cold.max_queue == 7 and route.cluster == "model.ns.b"  # type: ignore[attr-defined]


def test_versions_follow_content() -> None:
    one = r.build(MODELS, GatewaySettings())
    two = r.build(list(reversed(MODELS)), GatewaySettings())
    for type_url in one.by_type:
        assert r.version_of(one.by_type[type_url]) == r.version_of(two.by_type[type_url])
    moved = r.build(
        [MODELS[0], RoutedModel(key="ns/b", names=("b",), served_name="b", endpoints=(("127.0.0.1", 1),))],
        GatewaySettings(),
    )
    assert r.version_of(moved.by_type[ENDPOINT]) != r.version_of(one.by_type[ENDPOINT])
    assert r.version_of(moved.by_type[LISTENER]) == r.version_of(one.by_type[LISTENER])


def test_select_named_and_wildcard() -> None:
    built = r.build(MODELS, GatewaySettings())
    assert set(built.select(ENDPOINT, ["model.a"])) == {"model.a"}
    assert set(built.select(CLUSTER, ["ignored"])) == {"model.a", "model.ns.b"}


def test_a_gateway_whose_envoy_has_not_confirmed_an_endpoint_sees_it_as_no_adapters_holder() -> None:
    sql = RoutedAdapter(name="sql", names=("sql",), served_name="sql", endpoints=("127.0.0.1:9000", "127.0.0.1:9001"))
    model = replace(MODELS[0], adapters=(sql,), adapters_on_demand=True)
    base = r.build([model], GatewaySettings())
    assert list(base.by_type[MODEL_ROUTE]["a"].adapters[0].endpoints) == ["127.0.0.1:9000", "127.0.0.1:9001"]  # type: ignore[attr-defined]
    gated = r.build([model], GatewaySettings(), confirmed={model.cluster: frozenset({("127.0.0.1", 9000)})})
    route = gated.by_type[MODEL_ROUTE]["a"]
    assert [(e.address, e.port) for e in route.endpoints] == [("127.0.0.1", 9000)]  # type: ignore[attr-defined]
    assert list(route.adapters[0].endpoints) == ["127.0.0.1:9000"]  # type: ignore[attr-defined]


def test_retries_are_off_unless_asked_and_then_go_to_hosts_not_tried() -> None:
    plain = json_format.MessageToDict(r.build(MODELS, GatewaySettings()).by_type[ROUTE][ROUTE_NAME])
    # routes[0] is the park's (extproc/park.py); routes[1] the decided one, to the cluster extproc names.
    assert "retryPolicy" not in plain["virtualHosts"][0]["routes"][1]["route"]
    federated = [replace(MODELS[0], fallback_endpoints=2)]
    built = r.build(federated, GatewaySettings(upstream_retries=2))
    route = json_format.MessageToDict(built.by_type[ROUTE][ROUTE_NAME])["virtualHosts"][0]["routes"][1]
    policy = route["route"]["retryPolicy"]
    assert policy["retryOn"] == "connect-failure,refused-stream,reset-before-request,retriable-headers"
    assert policy["numRetries"] == 2
    # A member gateway's reply for a request no model server saw (tests/federation) is retried too.
    assert policy["retriableHeaders"] == [{"name": contract.UNSERVED_HEADER, "stringMatch": {"exact": "1"}}]
    assert policy["retryHostPredicate"][0]["name"] == "envoy.retry_host_predicates.previous_hosts"
    assert built.by_type[MODEL_ROUTE]["a"].fallback_endpoints == 2  # type: ignore[attr-defined]


@pytest.mark.parametrize("native", [False, True])
def test_the_first_route_parks_a_cold_request_at_the_extproc_cluster_and_follows_one_307(native: bool) -> None:
    models = [NATIVE] if native else MODELS
    built = r.build(models, GatewaySettings(native_allowed=native, replay=True))
    routes = json_format.MessageToDict(built.by_type[ROUTE][ROUTE_NAME])["virtualHosts"][0]["routes"]
    park = routes[0]
    parked = {"name": contract.CLUSTER_HEADER, "stringMatch": {"exact": contract.PARK_CLUSTER}}
    assert park["match"]["headers"] == [parked]
    assert park["route"]["cluster"] == contract.EXTPROC_CLUSTER and park["route"]["timeout"] == "0s"
    redirect = park["route"]["internalRedirectPolicy"]
    assert redirect["maxInternalRedirects"] == 1 and redirect["redirectResponseCodes"] == [307]
    # The release ticket goes with the request; the park's own headers are cleared from it.
    copied = {contract.RELEASE_HEADER, contract.CLUSTER_HEADER, contract.PARK_HEADER}
    assert set(redirect["responseHeadersToCopy"]) == copied
    # Retried until an extproc holds it: it reached no model server.
    policy = park["route"]["retryPolicy"]
    assert {"connect-failure", "reset", "refused-stream", "retriable-headers"} <= set(policy["retryOn"].split(","))
    assert policy["retriableHeaders"] == [{"name": contract.UNSERVED_HEADER, "stringMatch": {"exact": "1"}}]
    assert policy["numRetries"] == 30 and "retryPriority" in policy
    # A request that meets it first (a client's own header) is still decided by extproc.
    assert ("typedPerFilterConfig" in park) == native
    if native:
        assert park["typedPerFilterConfig"]["envoy.filters.http.ext_proc"].get("disabled") is None
    assert contract.EXTPROC_CLUSTER not in natively_routed(built.by_type[ROUTE][ROUTE_NAME])
    # Envoy's rate-counted mark names its header by reference into the first pass's route, which
    # may be gone when the request comes back: it never goes with a parked request.
    assert park["requestHeadersToRemove"] == [contract.RATE_COUNTED_HEADER]


@pytest.mark.parametrize("native", [False, True])
def test_a_released_request_is_decided_by_extproc_before_any_native_or_counted_route(native: bool) -> None:
    limited = replace(NATIVE if native else MODELS[0], requests_per_second=1.0, burst=2.0)
    # A limit Envoy keeps (the gateway may route natively), for a native and a decided model.
    built = r.build([limited], GatewaySettings(native_allowed=True, replay=True))
    routes = json_format.MessageToDict(built.by_type[ROUTE][ROUTE_NAME])["virtualHosts"][0]["routes"]
    names = [route.get("name") for route in routes]
    released = routes[names.index("released")]
    assert released["match"]["headers"] == [{"name": contract.RELEASE_HEADER, "presentMatch": True}]
    # Undecided (extproc names the cluster; replayed if its stream fails), and drawing no token.
    assert released["route"]["cluster"] == contract.REPLAY_CLUSTER and "metadata" not in released
    assert "disabled" not in released["typedPerFilterConfig"]["envoy.filters.http.ext_proc"]
    model_routes = [i for i, route in enumerate(routes) if "metadata" in route]
    assert model_routes and names.index("released") < min(model_routes)



@pytest.mark.parametrize(
    "settings",
    [
        GatewaySettings(upstream_header=True),
        GatewaySettings(upstream_retries=2, upstream_retry_on="reset"),
        GatewaySettings(upstream_header=True, native_allowed=True),
        GatewaySettings(native_allowed=True, key_checks=True),
    ],
    ids=["plain", "federation", "native", "native-keys"],
)
def test_envoy_validates_the_generated_config(tmp_path: Path, settings: GatewaySettings) -> None:
    """Put the dynamic resources into a static bootstrap and let the real Envoy validate it."""
    models = MODELS
    if settings.upstream_retries:  # the global gateway's routes: fallbacks and member tokens too
        token = (("127.0.0.1", 9000, "Bearer member-token"),)
        models = [replace(MODELS[0], fallback_endpoints=1, endpoint_authorization=token), MODELS[1]]
    if settings.native_allowed:
        models = [*MODELS, NATIVE]
    keys = gateway_keys([("sk-validate-0000", ALL_MODELS), ("sk-validate-1111", Scope(frozenset({"other"})))])
    built = r.build(models, settings, keys=keys)
    assert bool(natively_routed(built.by_type[ROUTE][ROUTE_NAME])) is settings.native_allowed
    assert_envoy_accepts(built, tmp_path)


def assert_envoy_accepts(built: r.Resources, tmp_path: Path) -> None:
    """`envoy --mode validate` on a static bootstrap made of `built`'s listener, routes and clusters."""
    listener = json_format.MessageToDict(built.by_type[LISTENER][LISTENER_NAME])
    hcm = listener["filterChains"][0]["filters"][0]["typedConfig"]
    hcm.pop("rds")
    hcm["routeConfig"] = json_format.MessageToDict(built.by_type[ROUTE][ROUTE_NAME])
    clusters = []
    for name, cluster in built.by_type[CLUSTER].items():
        as_dict = json_format.MessageToDict(cluster)
        as_dict.pop("edsClusterConfig")
        as_dict["type"] = "STATIC"
        as_dict["loadAssignment"] = json_format.MessageToDict(built.by_type[ENDPOINT][name])
        clusters.append(as_dict)
    clusters.append(
        {
            "name": contract.EXTPROC_CLUSTER,
            "type": "STATIC",
            "connectTimeout": "1s",
            "typedExtensionProtocolOptions": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicitHttpConfig": {"http2ProtocolOptions": {}},
                }
            },
            "loadAssignment": {
                "clusterName": contract.EXTPROC_CLUSTER,
                "endpoints": [
                    {
                        "lbEndpoints": [
                            {"endpoint": {"address": {"socketAddress": {"address": "127.0.0.1", "portValue": 1}}}}
                        ]
                    }
                ],
            },
        }
    )
    config = tmp_path / "envoy.json"
    config.write_text(json.dumps({"static_resources": {"listeners": [listener], "clusters": clusters}}))
    envoy = Path(sys.executable).parent / "envoy"
    result = subprocess.run(
        [str(envoy), "--mode", "validate", "-c", str(config)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_tls_members_get_their_own_transport_socket_and_plain_ones_stay_plain() -> None:
    named = UpstreamTls("east", "/s/ca.pem", server_name="east.example", cert_file="/s/c.pem", key_file="/s/k.pem")
    by_ip = UpstreamTls("west", "/s/west-ca.pem", ip_san="127.0.0.1")
    token = (("127.0.0.1", 9000, "Bearer member-token"),)
    model = replace(MODELS[0], endpoint_authorization=token, endpoint_tls=(("127.0.0.1", 9000, named),))
    built = r.build([model], GatewaySettings())
    cla = json_format.MessageToDict(built.by_type[ENDPOINT]["model.a"])
    metadata = {
        e["endpoint"]["address"]["socketAddress"]["portValue"]: e.get("metadata")
        for e in cla["endpoints"][0]["lbEndpoints"]
    }
    assert metadata[9000] == {
        "filterMetadata": {
            "wakegate": {"authorization": "Bearer member-token"},
            "envoy.transport_socket_match": {TLS_MATCH_KEY: "east"},
        }
    }
    assert metadata[9001] is None  # no match: the cluster's default, plain text
    cluster = json_format.MessageToDict(built.by_type[CLUSTER]["model.a"])
    (match,) = cluster["transportSocketMatches"]
    assert match["match"] == {TLS_MATCH_KEY: "east"} and "transportSocket" not in cluster
    context = match["transportSocket"]["typedConfig"]
    assert context["sni"] == "east.example"
    common = context["commonTlsContext"]
    assert common["validationContext"] == {
        "trustedCa": {"filename": "/s/ca.pem"},
        "matchTypedSubjectAltNames": [{"sanType": "DNS", "matcher": {"exact": "east.example"}}],
    }
    assert common["tlsCertificates"] == [
        {"certificateChain": {"filename": "/s/c.pem"}, "privateKey": {"filename": "/s/k.pem"}}
    ]
    # Checked by IP, no SNI and no client certificate.
    model = replace(MODELS[0], endpoint_tls=(("127.0.0.1", 9001, by_ip),))
    cluster = json_format.MessageToDict(r.build([model], GatewaySettings()).by_type[CLUSTER]["model.a"])
    context = cluster["transportSocketMatches"][0]["transportSocket"]["typedConfig"]
    assert "sni" not in context and "tlsCertificates" not in context["commonTlsContext"]
    assert context["commonTlsContext"]["validationContext"]["matchTypedSubjectAltNames"] == [
        {"sanType": "IP_ADDRESS", "matcher": {"exact": "127.0.0.1"}}
    ]
    plain = json_format.MessageToDict(r.build(MODELS, GatewaySettings()).by_type[CLUSTER]["model.a"])
    assert "transportSocketMatches" not in plain


def test_member_tokens_go_to_their_endpoint_only_and_never_to_extproc() -> None:
    token = (("127.0.0.1", 9000, "Bearer member-token"),)
    built = r.build([replace(MODELS[0], endpoint_authorization=token)], GatewaySettings())
    cla = json_format.MessageToDict(built.by_type[ENDPOINT]["model.a"])
    metadata = {
        e["endpoint"]["address"]["socketAddress"]["portValue"]: e.get("metadata")
        for e in cla["endpoints"][0]["lbEndpoints"]
    }
    assert metadata[9000] == {"filterMetadata": {"wakegate": {"authorization": "Bearer member-token"}}}
    assert metadata[9001] is None
    cluster = json_format.MessageToDict(built.by_type[CLUSTER]["model.a"])
    options = next(iter(cluster["typedExtensionProtocolOptions"].values()))
    assert [f["name"] for f in options["httpFilters"]] == [
        "envoy.filters.http.header_mutation",
        "envoy.filters.http.upstream_codec",
    ]
    assert "member-token" not in str(built.by_type[MODEL_ROUTE]["a"])
    plain = json_format.MessageToDict(r.build(MODELS, GatewaySettings()).by_type[CLUSTER]["model.a"])
    assert "httpFilters" not in next(iter(plain["typedExtensionProtocolOptions"].values()))


def _flow_model(backend: str, flow: str) -> r.Model:
    from wakegate.control.manifests import parse_manifest

    text = f"""apiVersion: wakegate.io/v1alpha1
kind: Model
metadata: {{name: fc}}
spec: {{backend: {backend}, command: [x], source: "file:///m.gguf", flowControl: {flow}}}
"""
    return parse_manifest(text).models[0]


def test_flow_control_thresholds_default_per_engine_and_keep_the_model_decided() -> None:
    vllm = routed_model(_flow_model("vllm", "{enabled: true}"), [("10.0.0.1", 8000)])
    assert vllm.flow == RoutedFlow(max_waiting=5, max_kv_usage=0.9)
    llama = routed_flow(_flow_model("llamacpp", "{enabled: true, band: critical}"))
    assert llama is not None and (llama.max_waiting, llama.band) == (1, "critical")
    ollama = routed_flow(_flow_model("ollama", "{enabled: true}"))
    assert ollama is not None and (ollama.max_waiting, ollama.max_in_flight) == (0, 4)  # no load metrics
    own = routed_flow(_flow_model("sim", "{enabled: true, saturation: {maxWaiting: 0, maxInFlight: 3}}"))
    assert own is not None and (own.max_waiting, own.max_kv_usage, own.max_in_flight) == (0, 0.9, 3)
    assert routed_flow(_flow_model("sim", "{enabled: false}")) is None
    native = replace(vllm, path="native", strategy="round-robin", profile="")
    settings = GatewaySettings(native_allowed=True)
    assert native_blocker(native, settings) == "flow control (requests are admitted by extproc)"
    assert native_blocker(replace(native, flow=None), settings) == ""
    route = model_route(vllm)
    assert route.flow.enabled and route.flow.max_waiting == 5 and route.flow.queue_timeout_ms == 30000


async def test_the_digest_memo_keeps_only_what_recent_snapshots_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """A feeder that republishes as models wake and idle must not keep every message it ever
    built: the digest memo holds its messages alive, and it once grew a feeder by about a
    megabyte a minute (tests/bench/bench_soak.py)."""
    from wakegate.control.feeder.cache import SnapshotCache

    monkeypatch.setattr(r, "DIGEST_MEMO_SLACK", 16)  # a small slack: a few hundred builds show the bound
    cache = SnapshotCache()
    memo = r.BuildMemo()
    sizes = []
    for i in range(300):
        # One model's replica comes and goes: each build makes new messages for it.
        endpoints = (("127.0.0.1", 9000 + i % 7),) if i % 2 else ()
        built = r.build([replace(MODELS[0], endpoints=endpoints), MODELS[1]], r.GatewaySettings(), memo=memo)
        await cache.set(built)
        for type_url in built.by_type:  # what a stream does with each snapshot
            r.version_of(cache.snapshot.select(type_url, ()))
        sizes.append(len(r._DIGESTS))
    live = sum(len(v) for v in built.by_type.values())
    assert max(sizes) <= 2 * live + r.DIGEST_MEMO_SLACK + live, (live, max(sizes))
    # What the current snapshot uses stays memoised: no digest is computed again.
    assert all(id(m) in r._DIGESTS for v in cache.snapshot.by_type.values() for m in v.values())
