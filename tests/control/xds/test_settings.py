"""`wakegate xds` and `wakegate operator` settings: the native path only where the chart says it is safe."""

from __future__ import annotations

import argparse

from wakegate import contract
from wakegate.control.feeder import resources as r
from wakegate.control.feeder.envoy_types import MODEL_ROUTE, ROUTE, ROUTE_NAME
from wakegate.control.feeder.native import routing_path
from wakegate.control.feeder.routed import RoutedModel
from wakegate.control.feeder.routes import natively_routed
from wakegate.control.feeder.settings import GatewaySettings
from wakegate.control.operator import main as operator
from wakegate.control.xds import main as xds

WARM_NATIVE = RoutedModel(
    key="ns/n", names=("n",), served_name="n", strategy="round-robin", endpoints=(("10.0.0.1", 8000),), path="native"
)


def parsed(module: object, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)  # type: ignore[attr-defined]
    return parser.parse_args(list(argv))


def test_the_feeder_routes_natively_only_with_native_path() -> None:
    off = xds.Settings.from_args(parsed(xds, "--no-internal-auth")).gateway
    on = xds.Settings.from_args(parsed(xds, "--no-internal-auth", "--native-path")).gateway
    assert not off.native_allowed and on.native_allowed
    assert xds.Settings.from_args(parsed(xds, "--no-internal-auth", "--no-native-path")).gateway == off
    # What each builds for a warm round-robin Model that asks for native.
    assert not natively_routed(r.build([WARM_NATIVE], off).by_type[ROUTE][ROUTE_NAME])
    assert natively_routed(r.build([WARM_NATIVE], on).by_type[ROUTE][ROUTE_NAME]) == {"model.ns.n"}
    keys = "the gateway's native path is off (API keys or a global rate limit on the cluster)"
    assert routing_path(WARM_NATIVE, off) == {"routingPath": "decided", "routingPathReason": keys}
    assert routing_path(WARM_NATIVE, on) == {"routingPath": "native"}


def test_the_routes_tell_extproc_which_models_ask_for_native() -> None:
    built = r.build([WARM_NATIVE, RoutedModel(key="ns/d", names=("d",), served_name="d")], GatewaySettings())
    routes = built.by_type[MODEL_ROUTE]
    assert (routes["ns/n"].path, routes["ns/d"].path) == ("native", "decided")


def test_the_operator_says_what_the_feeder_does() -> None:
    assert operator.Settings.from_args(parsed(operator)).native_path is False
    assert operator.Settings.from_args(parsed(operator, "--native-path")).native_path is True


def test_the_feeder_replays_held_requests_unless_told_not_to() -> None:
    """The chart's gateway pod has one extproc: with replay, a request it held when it died goes
    through its Envoy again and waits for the restarted one (e2e/test_chaos.py measures it)."""
    on = xds.Settings.from_args(parsed(xds, "--no-internal-auth")).gateway
    off = xds.Settings.from_args(parsed(xds, "--no-internal-auth", "--no-replay")).gateway
    assert on.replay and not off.replay
    assert contract.REPLAY_LISTENER in r.build([WARM_NATIVE], on).by_type[r.LISTENER]
    assert contract.REPLAY_LISTENER not in r.build([WARM_NATIVE], off).by_type[r.LISTENER]
