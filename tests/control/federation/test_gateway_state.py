"""The global gateway's state as the federation cluster changes under it (no processes started)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.control.federation.test_members import FILE, report
from wakegate.control.federation.gateway import GatewayConfig, GlobalGateway
from wakegate.control.federation.members import MemberHealth
from wakegate.control.federation_schema import parse_federation
from wakegate.control.feeder.resources import MODEL_ROUTE

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
