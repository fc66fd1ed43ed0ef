"""Envoy's bootstrap has one source (envoy/bootstrap.yaml): `wakegate up` renders it at start, the
chart ships a rendering of it (charts/wakegate/files/envoy-bootstrap.yaml) that must not drift."""

from __future__ import annotations

import subprocess
from pathlib import Path

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


def test_up_rendering_names_the_shared_clusters_and_its_ports() -> None:
    config = yaml.safe_load(bootstrap.render("up-1", PORTS))
    assert config["node"] == {"id": "up-1", "cluster": contract.GATEWAY_NODE_CLUSTER}
    assert config["admin"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 19901}
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    assert set(clusters) == {contract.XDS_CLUSTER, contract.EXTPROC_CLUSTER, contract.ACTIVATOR_CLUSTER}
    assert clusters[contract.XDS_CLUSTER]["type"] == "STATIC"  # an IP literal needs no DNS
    ports = {
        name: c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
        for name, c in clusters.items()
    }
    assert ports[contract.XDS_CLUSTER] == {"address": "127.0.0.1", "port_value": 18000}
    assert ports[contract.EXTPROC_CLUSTER]["port_value"] == 19002
    assert ports[contract.ACTIVATOR_CLUSTER]["port_value"] == 19004
    assert "listeners" not in config["static_resources"]


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
    for name, text in (("up", bootstrap.render("up-1", PORTS)), ("cluster", bootstrap.render("pod", cluster_form))):
        config = tmp_path / f"{name}.yaml"
        config.write_text(text)
        result = subprocess.run(
            [bootstrap.envoy_binary(), "--mode", "validate", "-c", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, f"{name}: {result.stdout}{result.stderr}"
