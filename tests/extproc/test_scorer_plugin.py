"""A scorer is a module plus one line in `contract.SCORERS`: the example scorer in
tests/extproc/scorers/preferred.py, added to the built-in table, is weighed by a Model manifest and
picked with through extproc's Picker. :func:`register` adds one to extproc's registry by hand."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import yaml
from pydantic import Field, ValidationError

from tests.extproc.scorers import preferred
from wakegate import contract
from wakegate.control import schema
from wakegate.control.feeder.model_routes import model_route
from wakegate.control.feeder.routed import routed_model
from wakegate.extproc.picking import Picker
from wakegate.extproc.scorers import SCORERS, register, registry
from wakegate.v1 import routing_pb2

ENDPOINTS = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]

#: The built-in scorers plus the example: the one line a new scorer adds.
TABLE = (
    *contract.SCORERS,
    contract.ScorerSpec(
        "preferred", "The endpoint the client names in x-preferred-endpoint.", module="tests.extproc.scorers.preferred"
    ),
)

MANIFEST = """
apiVersion: wakegate.io/v1alpha1
kind: Model
metadata: {name: m}
spec:
  backend: sim
  routing: {weights: {preferred: 5, queue: 1}}
"""

# The Model schema as it is generated from TABLE: its routing.weights has a field per scorer.
PreferredWeights = schema.weights_model(TABLE)


class PreferredRouting(schema.Routing):
    weights: PreferredWeights | None = None


class PreferredSpec(schema.ModelSpec):
    routing: PreferredRouting = Field(default_factory=PreferredRouting)


class PreferredModel(schema.Model):
    spec: PreferredSpec


def pick_each(picker: Picker, key: str) -> None:
    """Each endpoint named in x-preferred-endpoint is picked, with the scorer's weight plus the queue's."""
    for wanted in (ENDPOINTS[2], ENDPOINTS[0], ENDPOINTS[1]):
        picked = picker.pick(key, "default", ENDPOINTS, {"x-preferred-endpoint": wanted}, None)
        assert picked == wanted
        assert picker.last is not None and picker.last.scores[wanted] == 6.0
    # Without the header the scorer gives no endpoint anything; the queue scorer alone ties them
    # all, so picks rotate among every endpoint.
    unnamed = {picker.pick(key, "default", ENDPOINTS, {}, None) for _ in range(6)}
    assert unnamed == set(ENDPOINTS)


def test_one_line_in_the_table_gives_a_model_weight_and_a_pickable_scorer() -> None:
    weights = PreferredWeights.model_json_schema()["properties"]
    assert list(weights) == ["queue", "kvCache", "prefix", "precise", "session", "preferred"]
    assert weights["preferred"]["description"] == "The endpoint the client names in x-preferred-endpoint."
    with pytest.raises(ValidationError, match="preferred"):  # the built-in schema has no such weight
        schema.Weights.model_validate({"preferred": 5})

    model = PreferredModel.model_validate(yaml.safe_load(MANIFEST))
    route = model_route(routed_model(model, [(e.split(":")[0], 8000) for e in ENDPOINTS]))
    assert dict(route.weights) == {"preferred": 5.0, "queue": 1.0}

    scorers = registry(TABLE)
    assert scorers["preferred"] is preferred.score and "preferred" not in SCORERS
    picker = Picker(scorers)
    picker.update([route])
    pick_each(picker, model.key)


def test_a_table_naming_a_scorer_twice_or_clashing_fields_is_refused() -> None:
    queue = contract.ScorerSpec("queue", "again")
    with pytest.raises(ValueError, match="'queue' is in the table twice"):
        registry((*contract.SCORERS, queue))
    with pytest.raises(ValueError, match="scorer fields clash"):
        schema.weights_model((*contract.SCORERS, queue))
    with pytest.raises(ValueError, match="scorer fields clash"):  # a field that is a method of the model
        schema.weights_model([contract.ScorerSpec("scorers", "")])


@pytest.fixture
def registered() -> Iterator[None]:
    register("preferred", preferred.score)  # by hand: extproc's registry only
    yield
    del SCORERS["preferred"]


def route(weights: dict[str, float]) -> routing_pb2.ModelRoute:
    return routing_pb2.ModelRoute(
        key="ns/m",
        names=["m"],
        served_name="m",
        cluster="model.ns.m",
        weights=weights,
        endpoints=[routing_pb2.Endpoint(address=e.split(":")[0], port=8000) for e in ENDPOINTS],
    )


@pytest.mark.usefixtures("registered")
def test_a_scorer_registered_by_hand_decides_the_pick_by_its_weight() -> None:
    picker = Picker()
    picker.update([route({"preferred": 5.0, "queue": 1.0})])
    pick_each(picker, "ns/m")


def test_a_name_registered_twice_is_refused_and_an_unregistered_one_is_ignored() -> None:
    with pytest.raises(ValueError, match="'queue' is registered already"):
        register("queue", preferred.score)
    picker = Picker()
    picker.update([route({"preferred": 5.0, "queue": 1.0})])  # not registered: only queue counts
    assert picker.weights("ns/m") == {"queue": 1.0}
