"""A real Prometheus scrapes a running `wakegate up`; after a scripted workload every dashboard
panel's query returns data and every alert rule evaluates without error.

The workload: requests (streaming, so the backend records time to first token), a cold start
from zero, a queue overflow (429 queue_full), a rate-limit rejection (429 rate_limited) and a
GPU-group swap. Prometheus is Debian's `prometheus` package; the test skips without it.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from dashboards.build import ALERTS_FILE
from dashboards.definitions import DASHBOARDS
from dashboards.grafana import expand
from tests.support.http import get_json, request
from tests.support.up import UpProcess, model_doc
from wakegate.control.admin import free_port

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="prometheus missing: apt-get install prometheus (CI installs it)"
)

SCRAPE = "1s"

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


def chat(model: str, *, stream: bool = False) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}


class Prometheus:
    def __init__(self, tmp: Path, up: UpProcess, envoy_admin: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.backends = tmp / "backends.json"
        self.backends.write_text("[]")
        config = {
            "global": {"scrape_interval": SCRAPE, "evaluation_interval": SCRAPE, "scrape_timeout": SCRAPE},
            "rule_files": [str(ALERTS_FILE)],
            "scrape_configs": [
                {"job_name": "wakegate-up", "static_configs": [{"targets": [f"127.0.0.1:{up.admin_port}"]}]},
                {
                    # The serving extproc's metrics (the gateway's own listener does not serve them).
                    "job_name": "wakegate-gateway",
                    "metrics_path": "/metrics/gateway",
                    "static_configs": [{"targets": [f"127.0.0.1:{up.admin_port}"]}],
                },
                {
                    "job_name": "envoy",
                    "metrics_path": "/stats/prometheus",
                    "static_configs": [{"targets": [envoy_admin]}],
                },
                {"job_name": "backends", "file_sd_configs": [{"files": [str(self.backends)]}]},
            ],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log_path = tmp / "prometheus.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        return get_json(url, timeout=10)

    def wait_ready(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()
            with contextlib.suppress(OSError):
                if request("GET", f"{self.url}/-/ready", timeout=2).status == 200:
                    return
            time.sleep(0.2)
        raise AssertionError(f"prometheus not ready:\n{self.log_path.read_text()}")

    def set_backends(self, up: UpProcess) -> None:
        """File service discovery: each ready backend replica, labelled with its model key."""
        targets = [
            {"targets": [f"127.0.0.1:{replica['port']}"], "labels": {"model": model["key"]}}
            for model in up.status()["models"]
            for replica in model["replicas"]
            if replica["state"] == "ready"
        ]
        tmp = self.backends.with_suffix(".tmp")
        tmp.write_text(json.dumps(targets))
        tmp.replace(self.backends)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[UpProcess, Prometheus]]:
    envoy_admin = f"127.0.0.1:{free_port()}"
    up = UpProcess(tmp_path, FLEET, "--envoy-admin-listen", envoy_admin)
    prom: Prometheus | None = None
    try:
        up.wait_ready({"warm": 1}, timeout=60)
        assert f"envoy_admin={envoy_admin}" in up.log(), up.log()
        prom = Prometheus(tmp_path, up, envoy_admin)
        prom.wait_ready()
        prom.set_backends(up)
        yield up, prom
    finally:
        if prom is not None:
            prom.stop()
        assert up.stop() == 0, up.log()


def workload(up: UpProcess, prom: Prometheus) -> None:
    url = f"{up.base_url}/chat/completions"
    for _ in range(5):
        assert request("POST", url, body=chat("warm", stream=True)).status == 200
        time.sleep(0.5)  # within limits.requestsPerSecond
    # A rate-limit rejection: a burst beyond `limits.burst`.
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda _: request("POST", url, body=chat("warm")).status, range(8)))
    assert 429 in statuses, statuses
    # A cold start with a queue overflow: maxQueue 1 holds one request, the rest get 429 queue_full.
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(request, "POST", url, body=chat("cold", stream=True), timeout=30) for _ in range(3)]
        responses = [f.result() for f in futures]
    codes = sorted(r.status for r in responses)
    assert codes == [200, 429, 429], [(r.status, r.text) for r in responses]
    assert all(r.json()["error"]["code"] == "queue_full" for r in responses if r.status == 429)
    # A GPU-group swap: g1 takes the group, then g2's demand takes it over.
    assert request("POST", url, body=chat("g1"), timeout=30).status == 200
    assert request("POST", url, body=chat("g2"), timeout=30).status == 200
    prom.set_backends(up)
    for model in ("cold", "g2"):
        assert request("POST", url, body=chat(model, stream=True)).status == 200


def test_every_panel_returns_data_and_every_alert_evaluates(stack: tuple[UpProcess, Prometheus]) -> None:
    up, prom = stack
    workload(up, prom)
    queries = [
        (f"{dashboard.uid}: {panel.title} [{target.legend}]", expand(target.expr))
        for dashboard in DASHBOARDS
        for panel in dashboard.panels
        for target in panel.targets
    ]
    deadline = time.monotonic() + 20
    empty: list[str] = queries and [name for name, _ in queries]
    while empty and time.monotonic() < deadline:
        time.sleep(1)
        empty = []
        for name, expr in queries:
            answer = prom.api("query", query=expr)
            assert answer["status"] == "success", (name, answer)
            if not answer["data"]["result"]:
                empty.append(f"{name}: {expr}")
    assert not empty, "panels without data:\n" + "\n".join(empty)

    rules = prom.api("rules")["data"]["groups"]
    evaluated = [rule for group in rules for rule in group["rules"]]
    assert len(evaluated) == len(yaml.safe_load(ALERTS_FILE.read_text())["groups"][0]["rules"])
    for rule in evaluated:
        assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
        assert prom.api("query", query=rule["query"])["status"] == "success", rule["name"]
