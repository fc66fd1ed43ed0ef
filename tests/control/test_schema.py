"""The Model manifest: defaults, validation messages that name document and field, the CRD kept in sync."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import yaml

from wakegate.control import crd
from wakegate.control.feeder.model_routes import model_route
from wakegate.control.feeder.routed import RoutedModel, routed_adapters, routed_model
from wakegate.control.manifests import ManifestError, parse_manifest, parse_models
from wakegate.control.schema import ColdMode
from wakegate.v1 import routing_pb2

MINIMAL = """
apiVersion: wakegate.io/v1alpha1
kind: Model
metadata: {name: small}
spec: {backend: sim}
"""


def test_defaults() -> None:
    (model,) = parse_models(MINIMAL)
    spec = model.spec
    assert (spec.scaling.min, spec.scaling.max, spec.scaling.idleTimeout, spec.scaling.activationTimeout) == (
        1,
        1,
        300,
        180,
    )
    assert spec.endpoint.maxQueue == 100 and spec.endpoint.coldMode is ColdMode.HOLD
    assert model.served_name == "small" and model.client_names == ["small"]


def test_routing_profile_and_weights_reach_the_route() -> None:
    (by_profile,) = parse_models(MINIMAL.replace("{backend: sim}", "{backend: sim, routing: {profile: balanced}}"))
    route = model_route(routed_model(by_profile, []))
    assert (route.profile, dict(route.weights)) == ("balanced", {})
    (by_weights,) = parse_models(
        MINIMAL.replace("{backend: sim}", "{backend: sim, routing: {weights: {prefix: 2, kvCache: 0.5, queue: 0}}}")
    )
    route = model_route(routed_model(by_weights, []))
    assert (route.profile, dict(route.weights)) == ("", {"prefix": 2.0, "kv-cache": 0.5})
    (plain,) = parse_models(MINIMAL)
    assert (model_route(routed_model(plain, [])).profile, plain.spec.routing.weights) == ("balanced", None)


def test_a_model_naming_no_routing_gets_the_default_profile_and_round_robin_is_asked_for() -> None:
    (plain,) = parse_models(MINIMAL)
    (explicit,) = parse_models(MINIMAL.replace("{backend: sim}", "{backend: sim, routing: {strategy: default}}"))
    (rr,) = parse_models(MINIMAL.replace("{backend: sim}", "{backend: sim, routing: {strategy: round-robin}}"))
    (ll,) = parse_models(MINIMAL.replace("{backend: sim}", "{backend: sim, routing: {strategy: least-loaded}}"))
    routes = [model_route(routed_model(m, [])) for m in (plain, explicit, rr, ll)]
    # the CRD fills in strategy default, so naming it is the same as naming nothing
    assert [(r.profile, r.strategy) for r in routes] == [
        ("balanced", routing_pb2.STRATEGY_DEFAULT),
        ("balanced", routing_pb2.STRATEGY_DEFAULT),
        ("", routing_pb2.STRATEGY_ROUND_ROBIN),
        ("", routing_pb2.STRATEGY_LEAST_LOADED),
    ]
    with pytest.raises(ValueError, match=r"routing\.strategy cannot be combined"):
        parse_models(
            MINIMAL.replace("{backend: sim}", "{backend: sim, routing: {strategy: round-robin, profile: balanced}}")
        )


def test_precise_needs_to_know_where_the_engines_publish() -> None:
    with pytest.raises(ValueError, match=r"routing\.kvEvents"):
        parse_models(MINIMAL.replace("{backend: sim}", "{backend: sim, routing: {profile: precise}}"))
    with pytest.raises(ValueError, match=r"routing\.kvEvents"):
        parse_models(MINIMAL.replace("{backend: sim}", "{backend: sim, routing: {weights: {precise: 1}}}"))
    (model,) = parse_models(
        MINIMAL.replace("{backend: sim}", "{backend: sim, routing: {profile: precise, kvEvents: {portOffset: 1}}}")
    )
    route = model_route(routed_model(model, []))
    assert (route.profile, route.kv_events_offset, route.kv_events_replay_offset) == ("precise", 1, 0)
    with pytest.raises(ValueError, match="portOffset"):
        parse_models(MINIMAL.replace("{backend: sim}", "{backend: sim, routing: {kvEvents: {portOffset: 0}}}"))


def test_names_are_deduplicated_in_order() -> None:
    (model,) = parse_models(MINIMAL.replace("{backend: sim}", "{backend: sim, servedName: org/s, aliases: [s, small]}"))
    assert model.client_names == ["small", "org/s", "s"]


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ("{backend: nope}", "spec.backend: Value error, unknown backend 'nope'"),
        ("{backend: sim, scaling: {min: 3, max: 2}}", "spec.scaling"),
        ("{backend: sim, scaling: {min: -1}}", "spec.scaling.min"),
        ("{backend: sim, endpoint: {coldMode: sometimes}}", "spec.endpoint.coldMode"),
        ("{backend: sim, routing: {strategy: random}}", "spec.routing.strategy"),
        ("{backend: sim, routing: {profile: fastest}}", "spec.routing.profile"),
        ("{backend: sim, routing: {weights: {prefix: -1}}}", "spec.routing.weights.prefix"),
        ("{backend: sim, routing: {weights: {cache: 1}}}", "spec.routing.weights.cache: Extra inputs"),
        ("{backend: sim, routing: {weights: {}}}", "routing.weights needs at least one weight above 0"),
        (
            "{backend: sim, routing: {profile: balanced, weights: {queue: 1}}}",
            "routing takes a profile or weights, not both",
        ),
        (
            "{backend: sim, routing: {strategy: prefix, profile: balanced}}",
            "routing.strategy cannot be combined with a profile or weights",
        ),
        ("{backend: sim, surprise: 1}", "spec.surprise: Extra inputs are not permitted"),
        ("{backend: sim, aliases: ['has space']}", "spec.aliases[0]"),
        ("{backend: sim, source: 'oci://img:latest'}", "oci://img:latest: name a registry and a repository"),
        ("{backend: sim, source: 'oci://r.io/Models/x:v1'}", "spec.source"),
        ("{backend: sim, source: 's3://bucket/model'}", "spec.source"),
        ("{backend: sim, cache: {strategy: always}}", "spec.cache.strategy"),
    ],
)
def test_invalid_fields_are_named(patch: str, needle: str) -> None:
    text = MINIMAL + "---\n" + MINIMAL.replace("small", "second").replace("{backend: sim}", patch)
    with pytest.raises(ManifestError) as caught:
        parse_models(text, "models.yaml")
    message = str(caught.value)
    assert message.startswith("models.yaml: document 2 (Model 'second'):"), message
    assert needle in message


def test_bad_yaml_and_empty_and_wrong_kind() -> None:
    with pytest.raises(ManifestError, match="not valid YAML"):
        parse_models("a: [")
    with pytest.raises(ManifestError, match="no Model documents"):
        parse_models("---\n")
    with pytest.raises(ManifestError, match="kind"):
        parse_models(MINIMAL.replace("kind: Model", "kind: Deployment"))
    with pytest.raises(ManifestError, match="expected a mapping"):
        parse_models("- a\n- b\n")


def test_a_name_may_belong_to_one_model_only() -> None:
    text = (
        MINIMAL
        + "---\n"
        + MINIMAL.replace("name: small", "name: other").replace("{backend: sim}", "{backend: sim, aliases: [small]}")
    )
    with pytest.raises(ManifestError, match="'small' is already used by Model 'small'"):
        parse_models(text)


def test_committed_crd_matches_schema() -> None:
    for name, text in crd.render().items():
        committed = (crd.CRD_DIR / name).read_text()
        assert committed == text, f"{name} is stale: run python -m wakegate.control.crd"


def test_crd_schema_is_structural() -> None:
    schema = crd.model_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]

    def walk(node: object, path: str) -> None:
        if isinstance(node, dict):
            assert "$ref" not in node and "anyOf" not in node, path
            if "properties" in node:
                assert node.get("type") == "object", path
            for key, value in node.items():
                walk(value, f"{path}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")

    walk(schema, "spec")
    assert schema["properties"]["scaling"]["properties"]["idleTimeout"]["default"] == 300
    assert schema["properties"]["gpu"]["properties"]["shared"]["nullable"] is True
    yaml.safe_dump(schema)


@pytest.mark.parametrize(
    "source",
    [
        "oci://127.0.0.1:5000/models/tiny:v1",
        "oci://registry.example.com/models/tiny@sha256:" + "a" * 64,
        "oci://localhost/models/tiny:v1@sha256:" + "b" * 64,
        "hf://org/repo@main/model.gguf",
        "pvc://weights/llama/model.gguf",
        "file://models/tiny.gguf",
    ],
)
def test_every_source_the_delivery_library_reads_is_a_valid_spec_source(source: str) -> None:
    text = MINIMAL.replace("{backend: sim}", f"{{backend: sim, source: '{source}', cache: {{strategy: node}}}}")
    (model,) = parse_models(text)
    assert model.spec.source == source
    assert model.spec.cache.strategy == "node"
    assert not model.spec.cache.flash


ADAPTERS = """
apiVersion: wakegate.io/v1alpha1
kind: Model
metadata: {name: base}
spec: {backend: llamacpp, source: "file://w/base.gguf", servedName: org/base, adapters: {maxAdapters: 2}}
---
apiVersion: wakegate.io/v1alpha1
kind: LoRAAdapter
metadata: {name: sql}
spec: {baseModel: base, source: "file://w/sql.gguf", servedName: tiny-sql, aliases: [sql-v1], scale: 0.5}
---
apiVersion: wakegate.io/v1alpha1
kind: LoRAAdapter
metadata: {name: poet}
spec: {baseModel: base, source: "oci://registry.example/loras/poet:v1"}
"""


def test_lora_adapters_attach_to_their_base_and_route_by_id_on_llamacpp() -> None:
    manifest = parse_manifest(ADAPTERS, "m.yaml")
    (base,) = manifest.models
    assert [a.name for a in base.adapters] == ["sql", "poet"] == [a.name for a in manifest.adapters]
    assert base.adapters[0].client_names == ["sql", "tiny-sql", "sql-v1"]
    route = model_route(routed_model(base, ()))
    assert [(a.name, list(a.names), a.served_name, a.lora_id, a.scale) for a in route.adapters] == [
        ("sql", ["sql", "tiny-sql", "sql-v1"], "tiny-sql", 0, 0.5),
        ("poet", ["poet"], "poet", 1, 1.0),
    ]
    # vLLM loads adapters by name: no ids.
    (vllm,) = parse_models(ADAPTERS.replace('backend: llamacpp, source: "file://w/base.gguf"', "backend: vllm"))
    assert not any(a.HasField("lora_id") for a in model_route(routed_model(vllm, ())).adapters)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (('baseModel: base, source: "oci', 'baseModel: other, source: "oci'), "spec.baseModel: no Model 'other'"),
        (("aliases: [sql-v1]", "aliases: [org/base]"), "name 'org/base' is already used by Model 'base'"),
        (("metadata: {name: poet}", "metadata: {name: sql}"), "already used by LoRAAdapter 'sql'"),
        (("oci://registry.example/loras/poet:v1", "s3://bucket/poet"), "spec.source"),
        (("scale: 0.5", "scale: 500"), "spec.scale"),
        (("maxAdapters: 2", "maxAdapters: 1"), "2 LoRAAdapters, more than spec.adapters.maxAdapters"),
        (("kind: LoRAAdapter", "kind: LoraAdapter"), "kind must be one of Model, LoRAAdapter, not 'LoraAdapter'"),
    ],
)
def test_bad_lora_adapters_are_refused_naming_the_document(change: tuple[str, str], message: str) -> None:
    with pytest.raises(ManifestError, match=r"m\.yaml") as refused:
        parse_manifest(ADAPTERS.replace(*change, 1), "m.yaml")
    assert message in str(refused.value)


def test_the_loraadapter_crd_shows_base_loaded_and_ready() -> None:
    generated = crd.loraadapter_crd()
    assert generated["spec"]["names"]["plural"] == "loraadapters"
    version = generated["spec"]["versions"][0]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Base"] == ".spec.baseModel" and columns["Loaded"] == ".status.loadedReplicas"
    assert columns["Ready"] == ".status.ready"
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert set(spec["required"]) == {"baseModel", "source"}


def test_engines_that_load_adapters_at_run_time_may_have_more_than_max_adapters() -> None:
    many = ADAPTERS.replace('backend: llamacpp, source: "file://w/base.gguf"', "backend: sim").replace(
        "maxAdapters: 2", "maxAdapters: 1, idleTimeout: 60, placement: random"
    )
    (base,) = parse_models(many, "m.yaml")
    assert len(base.adapters) == 2 and base.spec.adapters.idleTimeout == 60
    # On demand, the route says so and lists each adapter's holders and failures.
    routed = routed_model(
        base,
        [("127.0.0.1", 9000)],
        adapters=[
            replace(a, endpoints=("127.0.0.1:9000",), failed_loads=1, last_failure="gone")
            for a in routed_adapters(base)
        ],
    )
    route = model_route(routed)
    assert route.adapters_on_demand and route.adapter_placement == "random"
    assert [(list(a.endpoints), a.failed_loads, a.last_failure) for a in route.adapters] == [
        (["127.0.0.1:9000"], 1, "gone"),
        (["127.0.0.1:9000"], 1, "gone"),
    ]
    assert not model_route(routed_model(base, ())).adapters_on_demand
    with pytest.raises(ManifestError, match=r"spec\.adapters\.placement"):
        parse_models(many.replace("placement: random", "placement: nearest"), "m.yaml")


def test_adapters_survive_the_feed_from_up_to_its_feeder() -> None:
    from wakegate.control.up.feeder import decode, state_message

    def round_trip(model: RoutedModel) -> RoutedModel:
        (again,) = decode(json.loads(json.dumps(state_message([model])))).upserted
        return again

    (base,) = parse_models(ADAPTERS)
    routed = routed_model(base, [("127.0.0.1", 9000)])
    again = round_trip(routed)
    assert again.adapters == routed.adapters and again.adapters[0].names == ("sql", "tiny-sql", "sql-v1")

    # On demand: the holders and failures survive too.
    on_demand = routed_model(
        base,
        [("127.0.0.1", 9000)],
        adapters=[
            replace(a, endpoints=("127.0.0.1:9000",), failed_loads=2, last_failure="refused") for a in routed.adapters
        ],
    )
    again = round_trip(on_demand)
    assert again.adapters == on_demand.adapters and again.adapters_on_demand
