"""The replay path's configuration: what Envoy sends through itself again, and what it never does.

Its behaviour (held requests surviving extproc deaths and stalls) is tests/reliability/test_faults.py's,
with a real Envoy and `wakegate up`.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from wakegate import contract
from wakegate.control.feeder import resources as r
from wakegate.control.feeder.envoy_types import LISTENER, LISTENER_NAME, ROUTE, ROUTE_NAME
from wakegate.control.feeder.routed import RoutedModel
from wakegate.control.feeder.settings import GatewaySettings

MODELS = [
    RoutedModel(key="a", names=("a",), served_name="a", requests_per_second=2, burst=2),
    RoutedModel(key="b", names=("b",), served_name="b", path="native", endpoints=(("127.0.0.1", 9000),)),
]
SETTINGS = GatewaySettings(native_allowed=True, replay=True)


def _as_dict(message: Any) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def _hcm(listener: dict[str, Any]) -> dict[str, Any]:
    return listener["filter_chains"][0]["filters"][0]["typed_config"]  # type: ignore[no-any-return]


def _ext_proc(listener: dict[str, Any]) -> dict[str, Any]:
    return next(f for f in _hcm(listener)["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")


def _removed_early(listener: dict[str, Any]) -> set[str]:
    mutations = _hcm(listener)["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    return {m["remove"] for m in mutations if "remove" in m}


def test_only_requests_extproc_never_decided_are_sent_through_again() -> None:
    built = r.build(MODELS, SETTINGS)
    routes = _as_dict(built.by_type[ROUTE][ROUTE_NAME])["virtual_hosts"][0]["routes"]
    replaying = [route for route in routes if route.get("route", {}).get("cluster") == contract.REPLAY_CLUSTER]
    # Every route that would have answered "no route" (extproc names the cluster of every request
    # it decides) replays instead; no route that reaches a model server does.
    # First the park (a cold request waiting at an extproc), the decided route, the replayed one.
    assert routes[0]["route"]["cluster"] == contract.EXTPROC_CLUSTER
    assert replaying and not any("direct_response" in route for route in routes[3:])
    for route in routes:
        action = route.get("route", {})
        # The park's own answers (a stopping extproc's unserved 503) keep their mark.
        if action and action.get("cluster") not in (contract.REPLAY_CLUSTER, contract.EXTPROC_CLUSTER):
            assert route["response_headers_to_remove"] == [contract.UNSERVED_HEADER]  # a backend cannot claim it
    policy = replaying[0]["route"]["retry_policy"]
    # Retried only on the gateway's own "no extproc decided it" reply, or before anything was sent.
    assert set(policy["retry_on"].split(",")) == {"retriable-headers", "connect-failure", "reset-before-request"}
    assert policy["retriable_headers"] == [{"name": contract.UNSERVED_HEADER, "string_match": {"exact": "1"}}]
    # On the replay listener the replayed request is decided once more, never replayed again.
    assert routes[2]["match"]["headers"] == [{"name": contract.REPLAY_HEADER, "present_match": True}]
    assert routes[2]["direct_response"]["status"] == 404


def test_the_replay_listener_is_internal_keeps_the_gateways_marks_and_fails_with_the_retriable_503() -> None:
    listeners = r.build(MODELS, SETTINGS).by_type[LISTENER]
    outer, inner = _as_dict(listeners[LISTENER_NAME]), _as_dict(listeners[contract.REPLAY_LISTENER])
    assert "address" not in inner and "internal_listener" in inner
    assert _ext_proc(outer)["typed_config"]["failure_mode_allow"] is True
    assert not _ext_proc(inner)["typed_config"].get("failure_mode_allow")
    # A client cannot pose as a replay; the first pass's rate-limit mark stays on the replayed request.
    assert {contract.REPLAY_HEADER, contract.RATE_COUNTED_HEADER} <= _removed_early(outer)
    assert not {contract.REPLAY_HEADER, contract.RATE_COUNTED_HEADER} & _removed_early(inner)
    assert _hcm(inner)["stat_prefix"] != _hcm(outer)["stat_prefix"]  # the drain counts only real clients


def test_without_replay_nothing_changes() -> None:
    built = r.build(MODELS, GatewaySettings(native_allowed=True))
    assert set(built.by_type[LISTENER]) == {LISTENER_NAME}
    assert not _ext_proc(_as_dict(built.by_type[LISTENER][LISTENER_NAME]))["typed_config"].get(
        "failure_mode_allow"
    )
    config = _as_dict(built.by_type[ROUTE][ROUTE_NAME])
    assert config["response_headers_to_remove"] == [contract.UNSERVED_HEADER]
    assert contract.REPLAY_CLUSTER not in str(config)
