"""A real Prometheus scrapes a running `wakegate up`; after a scripted workload every dashboard
panel's query returns data and every alert rule evaluates without error.

The workload (tests/support/prometheus.py, shared with the chart's e2e check): requests (streaming,
so the backend records time to first token), a cold start from zero, a queue overflow (429
queue_full), a rate-limit rejection (429 rate_limited) and a GPU-group swap. Prometheus is Debian's
`prometheus` package; the test skips without it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.prometheus import (
    MISSING,
    Prometheus,
    assert_every_panel_returns_data_and_every_alert_evaluates,
    available,
    file_sd,
    workload,
)
from tests.support.required import missing
from tests.support.up import UpProcess, model_doc
from wakegate.control.admin import free_port


@pytest.fixture(autouse=True, scope="module")
def _prometheus_installed() -> None:
    if not available():
        missing(MISSING)


FLEET = "".join(
    [
        model_doc(
            "warm",
            extra="""  args: [--ttft-ms, "20", --tokens-per-second, "400"]
  limits: {requestsPerSecond: 2, burst: 4}
""",
        ),
        model_doc(
            "cold",
            extra="""  args: [--startup-seconds, "1.5"]
  scaling: {min: 0, max: 1, idleTimeout: 120, activationTimeout: 30}
  endpoint: {maxQueue: 1}
""",
        ),
        *(
            model_doc(
                name,
                extra="""  args: [--startup-seconds, "0.3"]
  scaling: {min: 0, max: 1, idleTimeout: 120, activationTimeout: 30}
  gpu: {shared: gpu0, minRunSeconds: 0, swapCooldownSeconds: 0, demandWindowSeconds: 0}
""",
            )
            for name in ("g1", "g2")
        ),
    ]
)


def scrape_configs(prom_dir: Path, up: UpProcess, envoy_admin: str) -> list[dict[str, Any]]:
    return [
        {"job_name": "wakegate-up", "static_configs": [{"targets": [f"127.0.0.1:{up.admin_port}"]}]},
        {
            # The serving extproc's metrics (the gateway's own listener does not serve them).
            "job_name": "wakegate-gateway",
            "metrics_path": "/metrics/gateway",
            "static_configs": [{"targets": [f"127.0.0.1:{up.admin_port}"]}],
        },
        {"job_name": "envoy", "metrics_path": "/stats/prometheus", "static_configs": [{"targets": [envoy_admin]}]},
        {"job_name": "backends", "file_sd_configs": file_sd(prom_dir, "backends")},
    ]


def set_backends(prom: Prometheus, up: UpProcess) -> None:
    """File service discovery: each ready backend replica, labelled with its model key."""
    prom.file_targets(
        "backends",
        [
            {"targets": [f"127.0.0.1:{replica['port']}"], "labels": {"model": model["key"]}}
            for model in up.status()["models"]
            for replica in model["replicas"]
            if replica["state"] == "ready"
        ],
    )


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[UpProcess, Prometheus]]:
    envoy_admin = f"127.0.0.1:{free_port()}"
    up = UpProcess(tmp_path, FLEET, "--envoy-admin-listen", envoy_admin)
    prom: Prometheus | None = None
    try:
        up.wait_ready({"warm": 1}, timeout=60)
        assert f"envoy_admin={envoy_admin}" in up.log(), up.log()
        prom = Prometheus(tmp_path, scrape_configs(tmp_path, up, envoy_admin))
        prom.wait_ready()
        set_backends(prom, up)
        yield up, prom
    finally:
        if prom is not None:
            prom.stop()
        assert up.stop() == 0, up.log()


def test_every_panel_returns_data_and_every_alert_evaluates(stack: tuple[UpProcess, Prometheus]) -> None:
    up, prom = stack
    workload(up.base_url, after_swap=lambda: set_backends(prom, up))
    assert_every_panel_returns_data_and_every_alert_evaluates(prom)
