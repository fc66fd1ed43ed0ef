"""A scorer is a module plus one registration line: the example scorer in
tests/extproc/scorers/preferred.py, registered and picked with through extproc's Picker."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.extproc.scorers import preferred
from wakegate.extproc.picking import Picker
from wakegate.extproc.scorers import SCORERS, register
from wakegate.v1 import routing_pb2

ENDPOINTS = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]


@pytest.fixture
def registered() -> Iterator[None]:
    register("preferred", preferred.score)  # the one registration line
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
def test_a_registered_scorer_decides_the_pick_by_its_weight() -> None:
    picker = Picker()
    picker.update([route({"preferred": 5.0, "queue": 1.0})])
    for wanted in (ENDPOINTS[2], ENDPOINTS[0], ENDPOINTS[1]):
        picked = picker.pick("ns/m", "default", ENDPOINTS, {"x-preferred-endpoint": wanted}, None)
        assert picked == wanted
        assert picker.last is not None and picker.last.scores[wanted] == 6.0
    # Without the header the scorer gives no endpoint anything; the queue scorer alone ties them
    # all, so picks rotate among every endpoint.
    unnamed = {picker.pick("ns/m", "default", ENDPOINTS, {}, None) for _ in range(6)}
    assert unnamed == set(ENDPOINTS)


def test_a_name_registered_twice_is_refused_and_an_unregistered_one_is_ignored() -> None:
    with pytest.raises(ValueError, match="'queue' is registered already"):
        register("queue", preferred.score)
    picker = Picker()
    picker.update([route({"preferred": 5.0, "queue": 1.0})])  # not registered: only queue counts
    assert picker.weights("ns/m") == {"queue": 1.0}
