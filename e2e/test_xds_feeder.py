"""`wakegate xds` on the real control plane: a read-only feeder turns Models + EndpointSlices into routes.

The feeder runs with a service account token bound to the read-only ClusterRole
docs/operator.md lists; the gateway (Envoy + extproc) gets no credentials.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.gateway import (
    XDS_RULES,
    Gateway,
    Operator,
    install_crds,
    refused_streams,
    running,
    scoped_kubeconfig,
    subscribe_without_token,
)
from e2e.helpers import Kube
from e2e.test_operator import apply, model_yaml, wait_phase
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture
def readonly_kubeconfig(kube: Kube, tmp_path: Path) -> Iterator[Path]:
    """A kubeconfig for a service account that may only read Models and EndpointSlices."""
    install_crds(kube.api)
    with scoped_kubeconfig(kube, tmp_path, "xds", XDS_RULES) as path:
        yield path


def _upstreams(gateway: Gateway, model: str, n: int) -> set[str]:
    import json
    import urllib.request

    seen = set()
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    for _ in range(n):
        request = urllib.request.Request(
            f"{gateway.url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            seen.add(resp.headers["x-wakegate-upstream"].rsplit(":", 1)[0])
    return seen


def _ready_ips(kube: Kube, model: str) -> set[str]:
    return {
        p.status.pod_ip
        for p in kube.pods(f"wakegate.io/model={model}")
        if any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
        and not p.metadata.deletion_timestamp
    }


def test_feeder_replicas_route_ready_endpoints_with_read_only_credentials(
    kube: Kube, tmp_path: Path, readonly_kubeconfig: Path
) -> None:
    gateway = Gateway(tmp_path, readonly_kubeconfig)
    (tmp_path / "second").mkdir()
    second = Gateway(tmp_path / "second", readonly_kubeconfig)  # another feeder replica, its own gateway
    operator = Operator(tmp_path, kube.cluster.kubeconfig, kube.ns, "operator", ["--renew-seconds", "1"])
    spec: dict[str, Any] = {
        "scaling": {"min": 2, "max": 2, "engine": "builtin"},
        "aliases": ["pair-alias"],
        "args": ["--drain-seconds", "0"],
    }
    with running(operator, gateway, second):
        apply(kube, model_yaml("pair", **spec))
        wait_phase(kube, "pair", "Ready")
        ips = wait_for(lambda: len(_ready_ips(kube, "pair")) == 2 and _ready_ips(kube, "pair"), 60, "2 ready pods")
        assert ips
        wait_for(lambda: gateway.chat("pair-alias")[0] == 200, 30, "the alias to route")
        assert wait_for(lambda: _upstreams(gateway, "pair", 12) == ips, 30, "both pods to receive traffic")
        assert wait_for(lambda: _upstreams(second, "pair", 12) == ips, 30, "the second feeder's gateway too")
        # A stranger without the internal token (or with another) is refused and counted.
        feeder = f"127.0.0.1:{gateway.xds_port}"
        assert subscribe_without_token(feeder) == "UNAUTHENTICATED"
        assert subscribe_without_token(feeder, "not-the-token") == "UNAUTHENTICATED"
        assert refused_streams(f"127.0.0.1:{gateway.xds_admin}") == 2
        # One pod gone: the feeder drops its address, requests keep being answered by the other.
        victim = next(p for p in kube.pods("wakegate.io/model=pair") if p.status.pod_ip in ips)
        kube.core.delete_namespaced_pod(victim.metadata.name, kube.ns)
        survivors = ips - {victim.status.pod_ip}
        wait_for(lambda: victim.status.pod_ip not in _upstreams(gateway, "pair", 6), 30, "the victim dropped")
        assert _upstreams(gateway, "pair", 6) <= survivors | _ready_ips(kube, "pair")
        # Deleting the Model removes its route.
        kube.custom.delete_namespaced_custom_object("wakegate.io", "v1alpha1", kube.ns, "models", "pair")
        wait_for(lambda: gateway.chat("pair")[0] == 404, 30, "the route to go away")
        wait_for(lambda: second.chat("pair")[0] == 404, 30, "the route to go away behind the second feeder")
        log = (tmp_path / "xds.log").read_text()
        assert "Forbidden" not in log, log[-2000:]
