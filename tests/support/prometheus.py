"""A real Prometheus (Debian's `prometheus` package) for tests, and the check the dashboards must pass.

Used by tests/dashboards/test_prometheus.py (scraping `wakegate up`) and e2e/test_observability.py
(scraping a chart install): the same rule file, the same panel queries, the same verdict.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from dashboards.build import ALERTS_FILE
from dashboards.definitions import DASHBOARDS
from dashboards.grafana import expand
from tests.support.http import get_json, request
from tests.support.processes import stop_process
from wakegate.control.admin import free_port

#: Scrape and rule evaluation interval of the tests' Prometheus.
SCRAPE = "1s"
MISSING = "prometheus missing: apt-get install prometheus (scripts/test installs it)"


def available() -> bool:
    return shutil.which("prometheus") is not None


def file_sd(tmp: Path, name: str) -> list[dict[str, Any]]:
    """A scrape config's `file_sd_configs`: the file `Prometheus.file_targets(name, ...)` writes
    in the same folder (no targets until then)."""
    path = tmp / f"{name}.json"
    path.write_text("[]")
    return [{"files": [str(path)]}]


class Prometheus:
    """One Prometheus process with wakegate's rule file and the given scrape configs.

    `file_targets(name, groups)` rewrites the file service discovery file `file_sd(tmp, name)`
    named in a scrape config; Prometheus re-reads it when it changes.
    """

    def __init__(self, tmp: Path, scrape_configs: list[dict[str, Any]]) -> None:
        self.dir = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": SCRAPE, "evaluation_interval": SCRAPE, "scrape_timeout": SCRAPE},
            "rule_files": [str(ALERTS_FILE)],
            "scrape_configs": scrape_configs,
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

    def file_targets(self, name: str, groups: list[dict[str, Any]]) -> None:
        """Replace the targets of `file_sd(name)` at once (written aside, then renamed)."""
        tmp = self.dir / f"{name}.tmp"
        tmp.write_text(json.dumps(groups))
        tmp.replace(self.dir / f"{name}.json")

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

    def stop(self) -> None:
        stop_process(self.proc, self._log, timeout=10)


def assert_every_panel_returns_data_and_every_alert_evaluates(prom: Prometheus, within: float = 20) -> None:
    """Every target of every dashboard panel answers with data (polled up to `within` seconds, as
    scrapes land), and every alert rule of the rule file evaluated with health `ok`."""
    queries = [
        (f"{dashboard.uid}: {panel.title} [{target.legend}]", expand(target.expr))
        for dashboard in DASHBOARDS
        for panel in dashboard.panels
        for target in panel.targets
    ]
    deadline = time.monotonic() + within
    empty = [name for name, _ in queries]
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


def chat(model: str, *, stream: bool = False) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}


def workload(
    url: str,
    *,
    headers: dict[str, str] | None = None,
    after_swap: Callable[[], None] = lambda: None,
    cold_timeout: float = 30,
) -> None:
    """What the dashboards need to have seen, against a gateway's `/v1` base `url` serving the models
    `warm` (limits 2 rps, burst 4; flow control with one request in flight: a burst waits), `cold`
    (from zero, maxQueue 1) and `g1`, `g2` (one GPU group):
    streaming requests (time to first token), a rate-limit rejection, a cold start with a queue
    overflow (429 queue_full) and a GPU-group swap (g1 takes the group, then g2's demand takes it)."""
    url = f"{url}/chat/completions"

    def post(model: str, stream: bool = False, timeout: float = 15) -> Any:
        return request("POST", url, headers=headers, body=chat(model, stream=stream), timeout=timeout)

    for _ in range(5):
        answer = post("warm", stream=True)
        assert answer.status == 200, answer.text
        time.sleep(0.5)  # within limits.requestsPerSecond
    # A rate-limit rejection: a burst beyond `limits.burst`; those admitted wait for flow control.
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda _: post("warm").status, range(8)))
    assert 429 in statuses, statuses
    # A cold start with a queue overflow: maxQueue 1 holds one request, the rest get 429 queue_full.
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(post, "cold", True, cold_timeout) for _ in range(3)]
        responses = [f.result() for f in futures]
    codes = sorted(r.status for r in responses)
    assert codes == [200, 429, 429], [(r.status, r.text) for r in responses]
    assert all(r.json()["error"]["code"] == "queue_full" for r in responses if r.status == 429)
    # A GPU-group swap: g1 takes the group, then g2's demand takes it over.
    for model in ("g1", "g2"):
        answer = post(model, timeout=cold_timeout)
        assert answer.status == 200, (model, answer.text)
    after_swap()
    for model in ("cold", "g2"):
        answer = post(model, stream=True)
        assert answer.status == 200, (model, answer.text)
