"""Envoy's bootstrap has one source (envoy/bootstrap.yaml): `wakegate up` renders it at start, the
chart ships a rendering of it (charts/wakegate/files/envoy-bootstrap.yaml) that must not drift."""

from __future__ import annotations

import asyncio
import os
import resource
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from wakegate import contract
from wakegate.control import bootstrap
from wakegate.control.admin import free_port
from wakegate.control.feeder import resources
from wakegate.control.feeder.ads import start_server
from wakegate.control.feeder.cache import SnapshotCache
from wakegate.control.feeder.settings import GatewaySettings
from wakegate.internal_token import ENV, Authenticator, TokenSource

PORTS = bootstrap.GatewayPorts(envoy_admin=19901, xds=18000, extproc=19002, activator=19004)


def test_the_chart_bootstrap_is_the_rendered_template() -> None:
    assert bootstrap.CHART_FILE.read_text() == bootstrap.chart_bootstrap(), (
        "run `python -m wakegate.control.bootstrap` and commit the result"
    )


def test_the_sync_check_fails_when_either_side_is_edited_alone() -> None:
    template = bootstrap.template_path().read_text()
    committed = bootstrap.CHART_FILE.read_text()
    before, after = "global_downstream_max_connections: 50000", "global_downstream_max_connections: 1"
    edited_template = template.replace(before, after)
    assert edited_template != template
    assert bootstrap.chart_bootstrap(edited_template) != committed
    edited_chart = committed.replace(before, after)
    assert edited_chart != committed
    assert edited_chart != bootstrap.chart_bootstrap()


UP_PORTS = bootstrap.GatewayPorts(
    envoy_admin=0,
    xds=18000,
    extproc=19002,
    activator=19004,
    extproc_standby=19012,
    activator_standby=19014,
    admin_socket="/run/wakegate/envoy-admin.sock",
)


def _addresses(cluster: dict[str, Any]) -> list[tuple[int, int]]:
    """(priority, port) of each endpoint of a cluster."""
    return [
        (group.get("priority", 0), lb["endpoint"]["address"]["socket_address"]["port_value"])
        for group in cluster["load_assignment"]["endpoints"]
        for lb in group["lb_endpoints"]
    ]


def test_up_rendering_names_the_shared_clusters_and_its_ports() -> None:
    config = yaml.safe_load(bootstrap.render("up-1", UP_PORTS))
    assert config["node"] == {"id": "up-1", "cluster": contract.GATEWAY_NODE_CLUSTER}
    # The admin API is an owner-only Unix socket: no TCP port anyone on the host could POST /quitquitquit to.
    assert config["admin"]["address"] == {"pipe": {"path": "/run/wakegate/envoy-admin.sock", "mode": 0o600}}
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    assert set(clusters) == {
        contract.XDS_CLUSTER,
        contract.EXTPROC_CLUSTER,
        contract.ACTIVATOR_CLUSTER,
        contract.REPLAY_CLUSTER,
        contract.access_log_cluster(0),
        contract.access_log_cluster(1),
    }
    assert clusters[contract.XDS_CLUSTER]["type"] == "STATIC"  # an IP literal needs no DNS
    # Requests sent through again go to this Envoy's own internal listener, never off the machine.
    replay = clusters[contract.REPLAY_CLUSTER]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert replay["address"] == {"envoy_internal_address": {"server_listener_name": contract.REPLAY_LISTENER}}
    assert _addresses(clusters[contract.XDS_CLUSTER]) == [(0, 18000)]
    # Active and standby: the standby takes traffic only while the active one fails its health checks.
    assert _addresses(clusters[contract.EXTPROC_CLUSTER]) == [(0, 19002), (1, 19012)]
    assert clusters[contract.EXTPROC_CLUSTER]["health_checks"][0]["grpc_health_check"] == {"service_name": ""}
    assert _addresses(clusters[contract.ACTIVATOR_CLUSTER]) == [(0, 19004), (1, 19014)]
    # Each extproc hears of every finished request.
    assert _addresses(clusters[contract.access_log_cluster(0)]) == [(0, 19002)]
    assert _addresses(clusters[contract.access_log_cluster(1)]) == [(0, 19012)]
    assert "listeners" not in config["static_resources"]


def test_one_extproc_has_no_standby_and_one_access_log_cluster() -> None:
    config = yaml.safe_load(bootstrap.render("up-1", PORTS))
    assert config["admin"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 19901}
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    assert _addresses(clusters[contract.EXTPROC_CLUSTER]) == [(0, 19002)]
    assert "health_checks" not in clusters[contract.EXTPROC_CLUSTER]
    assert _addresses(clusters[contract.access_log_cluster(0)]) == [(0, 19002)]
    assert contract.access_log_cluster(1) not in clusters


def test_a_service_name_and_a_metrics_port_shape_the_cluster_form() -> None:
    ports = bootstrap.GatewayPorts(
        envoy_admin=9901, xds=18000, extproc=9002, activator=9004, xds_host="xds.wakegate.svc", metrics=9902
    )
    config = bootstrap.config("pod", ports)
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    assert clusters[contract.XDS_CLUSTER]["type"] == "STRICT_DNS"
    [listener] = config["static_resources"]["listeners"]
    assert listener["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 9902}
    assert "envoy_admin" in clusters


def test_envoy_validates_both_forms(tmp_path: Path) -> None:
    cluster_form = bootstrap.GatewayPorts(
        envoy_admin=9901, xds=18000, extproc=9002, activator=9004, xds_host="localhost", metrics=9902
    )
    forms = (("up", bootstrap.render("up-1", UP_PORTS)), ("cluster", bootstrap.render("pod", cluster_form)))
    for name, text in forms:
        config = tmp_path / f"{name}.yaml"
        config.write_text(text)
        result = subprocess.run(
            [bootstrap.envoy_binary(), "--mode", "validate", "-c", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, f"{name}: {result.stdout}{result.stderr}"


async def test_a_real_envoy_presents_the_token_from_a_file_or_the_environment(tmp_path: Path) -> None:
    """The feeder accepts Envoy's ADS stream only with the token; both ways Envoy can read it work."""
    cache = SnapshotCache()
    await cache.set(resources.build([], GatewaySettings(listen_port=free_port())))
    auth = Authenticator(TokenSource(None, environ={ENV: "the-token"}))
    server, ads, xds = await start_server(cache, "127.0.0.1:0", authenticator=auth)
    token_file = tmp_path / "token"
    token_file.write_text("the-token\n")
    cases = {
        "from-file": (bootstrap.TokenRef(file=str(token_file)), {}),
        "from-env": (bootstrap.TokenRef(), {ENV: "the-token"}),
        "wrong-env": (bootstrap.TokenRef(), {ENV: "another"}),
        "none": (None, {}),
    }
    envoys = []
    try:
        for node, (token, env) in cases.items():
            ports = bootstrap.GatewayPorts(envoy_admin=free_port(), xds=xds, extproc=free_port(), activator=free_port())
            config = tmp_path / f"{node}.yaml"
            config.write_text(bootstrap.render(node, ports, token))
            argv = [bootstrap.envoy_binary(), "-c", str(config), "--use-dynamic-base-id", "-l", "error"]
            clean = {k: v for k, v in os.environ.items() if k != ENV}
            envoys.append(subprocess.Popen(argv, env={**clean, **env}, stderr=subprocess.DEVNULL))
        for _ in range(300):
            if {"from-file", "from-env"} <= ads.stats.nodes.keys() and auth.refused.get("ads", 0) >= 2:
                break
            await asyncio.sleep(0.1)
        assert set(ads.stats.nodes) == {"from-file", "from-env"}, "only the Envoys with the token subscribed"
        assert auth.refused["ads"] >= 2, "the two without it were refused (they retry with backoff)"
        assert ads.stats.acks >= 4, "both accepted Envoys acknowledged their listener and clusters"
    finally:
        for envoy in envoys:
            envoy.terminate()
            envoy.wait(10)
        await server.stop(0)


def test_the_token_is_never_in_the_bootstrap(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-value\n")
    rendered = bootstrap.render("up-1", PORTS, bootstrap.TokenRef(file=str(token)))
    assert "s3cret-value" not in rendered and str(token) in rendered
    assert "environment_variable: WAKEGATE_INTERNAL_TOKEN" in bootstrap.render("pod", PORTS, bootstrap.TokenRef())


def test_envoys_client_connections_fit_its_descriptor_limit() -> None:
    # What the reserve leaves, never more than the template's cap, never below 64.
    assert bootstrap.downstream_cap(50000, 20000) == 20000 - 4096
    assert bootstrap.downstream_cap(50000, 1 << 20) == 50000
    assert bootstrap.downstream_cap(50000, 1024) == 64
    assert bootstrap.downstream_cap(50000, resource.RLIM_INFINITY) == 50000


def test_the_rendered_bootstrap_caps_clients_by_the_inherited_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda which: (8192, 8192))
    data = yaml.safe_load(bootstrap.render("n", UP_PORTS))
    overload = data["layered_runtime"]["layers"][0]["static_layer"]["overload"]
    assert overload["global_downstream_max_connections"] == 8192 - 4096
    # The chart's pods run under a container runtime's limit: its bootstrap keeps the template's.
    assert "global_downstream_max_connections: 50000" in bootstrap.chart_bootstrap()
