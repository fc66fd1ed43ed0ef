"""Envoy's bootstrap has one source (envoy/bootstrap.yaml): `wakegate up` renders it at start, the
chart ships a rendering of it (charts/wakegate/files/envoy-bootstrap.yaml) that must not drift."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from wakegate import contract
from wakegate.control import bootstrap

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
        contract.access_log_cluster(0),
        contract.access_log_cluster(1),
    }
    assert clusters[contract.XDS_CLUSTER]["type"] == "STATIC"  # an IP literal needs no DNS
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
