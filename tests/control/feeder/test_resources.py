"""The pure snapshot builder produces resources real Envoy accepts (checked by `envoy --mode validate`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import json_format

from wakegate import contract
from wakegate.control.feeder import resources as r

MODELS = [
    r.RoutedModel(
        key="a",
        names=("a", "alias"),
        served_name="org/a",
        strategy="least-loaded",
        endpoints=(("127.0.0.1", 9001), ("127.0.0.1", 9000)),
    ),
    r.RoutedModel(key="ns/b", names=("b",), served_name="b", cold_mode="keepalive", max_queue=7),
]


def test_build_has_every_type_and_one_cluster_per_model() -> None:
    built = r.build(MODELS, r.GatewaySettings())
    assert set(built.by_type[r.CLUSTER]) == {"model.a", "model.ns.b"}
    assert set(built.by_type[r.MODEL_ROUTE]) == {"a", "ns/b"}
    cla = built.by_type[r.ENDPOINT]["model.a"]
    ports = [e.endpoint.address.socket_address.port_value for e in cla.endpoints[0].lb_endpoints]  # type: ignore[attr-defined]
    assert ports == [9000, 9001]
    route = built.by_type[r.MODEL_ROUTE]["ns/b"]
    assert route.cold.max_queue == 7 and route.cluster == "model.ns.b"  # type: ignore[attr-defined]


def test_versions_follow_content() -> None:
    one = r.build(MODELS, r.GatewaySettings())
    two = r.build(list(reversed(MODELS)), r.GatewaySettings())
    for type_url in one.by_type:
        assert r.version_of(one.by_type[type_url]) == r.version_of(two.by_type[type_url])
    moved = r.build(
        [MODELS[0], r.RoutedModel(key="ns/b", names=("b",), served_name="b", endpoints=(("127.0.0.1", 1),))],
        r.GatewaySettings(),
    )
    assert r.version_of(moved.by_type[r.ENDPOINT]) != r.version_of(one.by_type[r.ENDPOINT])
    assert r.version_of(moved.by_type[r.LISTENER]) == r.version_of(one.by_type[r.LISTENER])


def test_select_named_and_wildcard() -> None:
    built = r.build(MODELS, r.GatewaySettings())
    assert set(built.select(r.ENDPOINT, ["model.a"])) == {"model.a"}
    assert set(built.select(r.CLUSTER, ["ignored"])) == {"model.a", "model.ns.b"}


NATIVE = r.RoutedModel(
    key="ns/n",
    names=("n", "n-alias"),
    served_name="n",
    strategy="round-robin",
    path="native",
    endpoints=(("127.0.0.1", 9002),),
)


@pytest.mark.parametrize("native", [False, True], ids=["decided", "native"])
def test_envoy_validates_the_generated_config(tmp_path: Path, native: bool) -> None:
    """Put the dynamic resources into a static bootstrap and let the real Envoy validate it."""
    models = [*MODELS, NATIVE] if native else MODELS
    built = r.build(models, r.GatewaySettings(upstream_header=True, native_allowed=native))
    assert bool(r.natively_routed(built.by_type[r.ROUTE][r.ROUTE_NAME])) is native
    listener = json_format.MessageToDict(built.by_type[r.LISTENER][r.LISTENER_NAME])
    hcm = listener["filterChains"][0]["filters"][0]["typedConfig"]
    hcm.pop("rds")
    hcm["routeConfig"] = json_format.MessageToDict(built.by_type[r.ROUTE][r.ROUTE_NAME])
    clusters = []
    for name, cluster in built.by_type[r.CLUSTER].items():
        as_dict = json_format.MessageToDict(cluster)
        as_dict.pop("edsClusterConfig")
        as_dict["type"] = "STATIC"
        as_dict["loadAssignment"] = json_format.MessageToDict(built.by_type[r.ENDPOINT][name])
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
