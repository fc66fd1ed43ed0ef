"""The global gateway's state as the federation cluster changes under it (no processes started)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from google.protobuf import json_format

from tests.control.federation.test_members import FILE, report
from wakegate import contract
from wakegate.control.federation.gateway import GatewayConfig, GlobalGateway
from wakegate.control.federation.members import MemberHealth
from wakegate.control.federation_schema import parse_federation
from wakegate.control.feeder.envoy_types import MODEL_ROUTE, ROUTE, ROUTE_NAME
from wakegate.control.feeder.resources import build

OTHER = """
---
apiVersion: wakegate.io/v1alpha1
kind: FederatedModel
metadata: {name: other}
spec:
  template: {backend: sim}
  placement: {clusters: [west]}
"""


async def test_members_and_models_follow_the_cluster_and_tokens_reach_only_routes(tmp_path: Path) -> None:
    first = parse_federation(FILE, "f.yaml")
    gateway = GlobalGateway(GatewayConfig(federation=first, token_files={}, state_dir=tmp_path))
    assert set(gateway.members) == {"east", "west", "lab"} and [r.key for r in gateway._routes] == ["chat"]

    gateway.update(parse_federation(FILE + OTHER, "f.yaml"), {"west": "member-token"})
    assert [r.key for r in gateway._routes] == ["chat", "other"]  # a new model is routed (held) at once
    for _ in range(3):  # the coalesced publish runs on the next turns of the loop
        await asyncio.sleep(0)
    assert set(gateway.publisher.cache.snapshot.by_type[MODEL_ROUTE]) == {"chat", "other"}
    gateway.health["west"] = MemberHealth().observed(report(ready=1, names=("other",)), 0.01, 1.0)
    gateway._recompute()
    other = next(r for r in gateway._routes if r.key == "other")
    assert other.endpoints == (("10.0.0.2", 8080),)
    assert other.endpoint_authorization == (("10.0.0.2", 8080, "Bearer member-token"),)
    assert "member-token" not in str(gateway.status())

    without_west = FILE.replace("metadata: {name: west, labels: {tier: gpu}}", "metadata: {name: north}")
    gateway.update(parse_federation(without_west.replace("10.0.0.2", "10.0.0.9"), "f.yaml"), {})
    assert set(gateway.members) == {"east", "north", "lab"} and "west" not in gateway.health
    assert gateway.proxy_status() == {"members": 3, "healthyMembers": 0}


async def test_a_tls_members_material_is_private_files_renamed_when_it_rotates(tmp_path: Path) -> None:
    from e2e.pki import PKI
    from wakegate.control.federation.probe import TlsFiles, TlsMaterial

    pki = PKI(tmp_path / "pki")
    client = pki.issue("global", "global gateway")
    text = FILE.replace('"http://10.0.0.1:8080"}', '"https://10.0.0.1:8443", caFile: ca.pem}')
    files = {"east": TlsFiles(pki.ca.cert, client.cert, client.key)}
    state = tmp_path / "state"
    gateway = GlobalGateway(
        GatewayConfig(federation=parse_federation(text, "f.yaml"), token_files={}, state_dir=state, tls_files=files)
    )
    gateway.health["east"] = MemberHealth().observed(report(ready=1), 0.01, 1.0)
    gateway._recompute()
    ((_, _, tls),) = next(r for r in gateway._routes if r.key == "chat").endpoint_tls
    assert (tls.name, tls.ip_san, tls.server_name) == ("east", "10.0.0.1", None)
    folder = state / "secrets" / "members" / "east"
    assert Path(tls.ca_file).read_text() == pki.ca.cert.read_text() and Path(tls.ca_file).parent == folder
    assert {p.stat().st_mode & 0o777 for p in folder.iterdir()} == {0o600} and folder.stat().st_mode & 0o777 == 0o700
    assert "BEGIN" not in str(gateway.status())
    # A new CA in the file: a new file name (Envoy loads the changed cluster), the old one gone.
    pki.ca.cert.write_text(PKI(tmp_path / "next").ca.cert.read_text())
    gateway._recompute()
    ((_, _, rotated),) = next(r for r in gateway._routes if r.key == "chat").endpoint_tls
    assert rotated.ca_file != tls.ca_file and not Path(tls.ca_file).exists()
    assert rotated.cert_file == tls.cert_file
    # Material from a Secret (--proxy) wins over files; none readable: east is no endpoint at all.
    gateway.member_tls = {"east": TlsMaterial(pki.ca.cert.read_text())}
    gateway._recompute()
    ((_, _, secret),) = next(r for r in gateway._routes if r.key == "chat").endpoint_tls
    assert secret.cert_file is None and secret.key_file is None
    gateway.member_tls = {}
    pki.ca.cert.unlink()
    gateway._recompute()
    chat = next(r for r in gateway._routes if r.key == "chat")
    assert chat.endpoints == () and chat.endpoint_tls == ()


@pytest.mark.parametrize(
    ("when", "conditions"),
    [
        ("unsent", {"connect-failure", "refused-stream", "reset-before-request"}),
        ("before-response", {"connect-failure", "refused-stream", "reset"}),
    ],
)
async def test_retries_happen_only_where_retries_when_allows(tmp_path: Path, when: str, conditions: set[str]) -> None:
    """`unsent` never retries a request a member may have taken (a reset after it was written)."""
    text = (
        FILE
        + f"""---
apiVersion: wakegate.io/v1alpha1
kind: GlobalProxy
metadata: {{name: global}}
spec: {{retries: {{attempts: 2, when: {when}}}}}
"""
    )
    gateway = GlobalGateway(
        GatewayConfig(federation=parse_federation(text, "f.yaml"), token_files={}, state_dir=tmp_path)
    )
    gateway.health["east"] = MemberHealth().observed(report(ready=1), 0.01, 1.0)
    gateway._recompute()
    built = build(gateway._routes, gateway.gateway)
    route = json_format.MessageToDict(built.by_type[ROUTE][ROUTE_NAME])["virtualHosts"][0]["routes"]
    # The members' route; the replay route (a request extproc never decided, sent through again)
    # and the park route (a cold request waiting at an extproc) have their own.
    (policy,) = [
        r["route"]["retryPolicy"]
        for r in route
        if "retryPolicy" in r.get("route", {})
        and r["route"].get("cluster") not in (contract.REPLAY_CLUSTER, contract.EXTPROC_CLUSTER)
    ]
    # retriable-headers: a member's reply no model server saw (x-wakegate-unserved) is retried in both
    assert set(policy["retryOn"].split(",")) == conditions | {"retriable-headers"}
    assert policy["numRetries"] == 2


class AckedRoutes:
    """Stands in for the ADS server: what the global extprocs acknowledged (cluster -> members)."""

    def __init__(self) -> None:
        self.held: dict[str, frozenset[tuple[str, int]]] = {}

    def retained(self, node: str) -> dict[str, frozenset[tuple[str, int]]]:
        return self.held


async def test_status_lists_the_members_requests_may_still_go_to(tmp_path: Path) -> None:
    """A member leaves /status's routes once the global extprocs dropped it, not when the gateway
    decided it (a request sent in between could still reach it: tests/federation)."""
    gateway = GlobalGateway(
        GatewayConfig(federation=parse_federation(FILE, "f.yaml"), token_files={}, state_dir=tmp_path)
    )
    gateway.health["east"] = MemberHealth().observed(report(ready=1), 0.01, 1.0)
    gateway._recompute()
    assert gateway.status()["routes"] == {"chat": ["east"]}  # no ADS server yet: the routes as computed
    acked = AckedRoutes()
    gateway.publisher.ads = acked  # type: ignore[assignment]
    (route,) = gateway._routes
    assert gateway.status()["routes"] == {"chat": []}  # the extprocs have not got it yet
    acked.held = {route.cluster: frozenset({("10.0.0.1", 8080)})}
    assert gateway.status()["routes"] == {"chat": ["east"]}
    gateway.health["east"] = MemberHealth().observed(report(ready=0), 0.01, 2.0)  # scaled to zero
    gateway._recompute()
    assert gateway._routes[0].endpoints == ()
    assert gateway.status()["routes"] == {"chat": ["east"]}  # until the extprocs acknowledge its removal
    acked.held = {route.cluster: frozenset()}
    assert gateway.status()["routes"] == {"chat": []}
