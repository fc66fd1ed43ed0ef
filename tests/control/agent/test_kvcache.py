"""The node's KV-cache usage annotation: which pods are read, what is written, and when nothing is."""

from __future__ import annotations

import http.server
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from wakegate.control.agent.kvcache import BACKEND_SELECTOR, KvCacheReader, engine_targets, node_usage
from wakegate.control.agent.main import NodeAgent
from wakegate.control.backends import BACKENDS
from wakegate.control.k8s import names
from wakegate.control.k8s.client import KubeError
from wakegate.control.placement.facts import NODE_KV_CACHE_USAGE, node_facts

VLLM = """# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.4
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.4
vllm:num_requests_running{engine="0",model_name="m"} 3.0
"""
LLAMACPP = """# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.875
llamacpp:requests_processing 1
"""


@pytest.fixture
def engines() -> Iterator[dict[str, str]]:
    """A loopback HTTP server answering each path with the page in the returned dict."""
    pages: dict[str, str] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            page = pages.get(self.path)
            body = (page or "not found").encode()
            self.send_response(200 if page is not None else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            return

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    pages["port"] = str(server.server_address[1])
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield pages
    server.shutdown()
    server.server_close()


def pod(name: str, backend: str, port: int, node: str = "n", phase: str = "Running", **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "labels": names.backend_labels(name),
            "annotations": {names.ANNOTATION_BACKEND: backend},
            **meta,
        },
        "spec": {
            "nodeName": node,
            "containers": [{"name": "backend", "ports": [{"name": "http", "containerPort": port}]}],
        },
        "status": {"phase": phase, "podIP": "127.0.0.1"},
    }


class PodsKube:
    """The API server's answer to the agent's pod list (the field selector is the server's job)."""

    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.items = pods
        self.queries: list[dict[str, str]] = []
        self.fail = False
        self.labels: dict[str, str] = {}
        self.annotations: dict[str, str] = {}
        self.patches: list[dict[str, Any]] = []

    def request(self, method: str, resource: str, body: Any = None, query: dict[str, str] | None = None) -> Any:
        assert (method, resource) == ("GET", "/api/v1/pods")
        if self.fail:
            raise KubeError(403, "Forbidden", "pods is forbidden")
        self.queries.append(dict(query or {}))
        return {"items": self.items}

    def get(self, resource: str) -> Any:
        return {"metadata": {"name": "n", "labels": self.labels, "annotations": self.annotations}}

    def merge_patch(self, resource: str, patch: dict[str, Any], field_manager: str) -> None:
        self.patches.append(patch)
        for key, value in patch["metadata"].get("annotations", {}).items():
            if value is None:
                self.annotations.pop(key, None)
            else:
                self.annotations[key] = value


def test_only_running_backend_pods_on_the_node_that_report_kv_usage_are_read() -> None:
    pods = [
        pod("a", "vllm", 8000),
        pod("b", "llamacpp", 8080),
        pod("elsewhere", "vllm", 8000, node="other"),
        pod("pending", "vllm", 8000, phase="Pending"),
        pod("going", "vllm", 8000, deletionTimestamp="2026-01-01T00:00:00Z"),
        pod("ollama", "ollama", 11434),  # reports no KV usage
    ]
    targets = engine_targets(pods, "n")
    assert [(t.pod, t.url, t.backend) for t in targets] == [
        ("ns/a", "http://127.0.0.1:8000/metrics", "vllm"),
        ("ns/b", "http://127.0.0.1:8080/metrics", "llamacpp"),
    ]


def test_the_runtimes_metrics_path_on_the_pod_wins_over_the_plugins() -> None:
    custom = pod("c", "vllm", 8000)
    custom["metadata"]["annotations"][names.ANNOTATION_METRICS_PATH] = "/engine/metrics"
    assert [t.url for t in engine_targets([custom], "n")] == ["http://127.0.0.1:8000/engine/metrics"]


def test_node_usage_is_the_highest_reported_and_none_without_reports() -> None:
    assert node_usage([0.2, None, 0.874]) == "0.87"
    assert node_usage([1.7]) == "1.00"
    assert node_usage([None]) is None and node_usage([]) is None


def test_the_agent_writes_the_busiest_engines_usage_where_the_extender_reads_it(engines: dict[str, str]) -> None:
    port = int(engines["port"])
    engines["/metrics"] = VLLM
    kube = PodsKube([pod("a", "vllm", port), pod("b", "llamacpp", port)])
    agent = NodeAgent(kube, "n", [], [], KvCacheReader(kube, "n"))  # type: ignore[arg-type]
    assert agent.sync() is True
    assert kube.queries == [{"fieldSelector": "spec.nodeName=n", "labelSelector": BACKEND_SELECTOR}]
    assert kube.annotations == {NODE_KV_CACHE_USAGE: "0.40"}
    engines["/metrics"] = VLLM + LLAMACPP  # both pods answer on the one port: the higher wins
    assert agent.sync() is True
    node = {"metadata": {"name": "n", "annotations": kube.annotations}}
    assert node_facts(node).kv_cache_usage == pytest.approx(0.88)
    assert agent.sync() is False  # unchanged: no patch
    kube.items = []
    assert agent.sync() is True
    assert NODE_KV_CACHE_USAGE not in kube.annotations


def test_an_engine_that_does_not_answer_is_left_out_with_one_line(
    engines: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    port = int(engines["port"])
    kube = PodsKube([pod("a", "vllm", port)])
    reader = KvCacheReader(kube, "n", timeout=1.0)
    with caplog.at_level(logging.INFO, logger="wakegate.agent"):
        assert reader.usage() is None
        assert reader.usage() is None
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["node n: no metrics from ns/a"]
    engines["/metrics"] = VLLM
    assert reader.usage() == "0.40"


def test_pods_that_cannot_be_listed_leave_the_annotation_and_say_so_once(caplog: pytest.LogCaptureFixture) -> None:
    kube = PodsKube([])
    kube.annotations = {NODE_KV_CACHE_USAGE: "0.50", "other": "x"}
    kube.fail = True
    agent = NodeAgent(kube, "n", [], [], KvCacheReader(kube, "n"))  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="wakegate.agent"):
        assert agent.sync() is False
        assert agent.sync() is False
    assert kube.annotations == {NODE_KV_CACHE_USAGE: "0.50", "other": "x"}
    assert len([r for r in caplog.records if "KV-cache" in r.getMessage()]) == 1


def test_without_the_flag_a_kv_annotation_is_not_the_agents() -> None:
    kube = PodsKube([])
    kube.annotations = {NODE_KV_CACHE_USAGE: "0.50"}
    assert NodeAgent(kube, "n", [], []).sync() is False  # type: ignore[arg-type]
    assert kube.annotations == {NODE_KV_CACHE_USAGE: "0.50"}


def test_an_engine_with_several_caches_reports_its_fullest() -> None:
    metrics = BACKENDS["vllm"].load_metrics
    assert metrics is not None
    page = 'vllm:kv_cache_usage_perc{engine="0"} 0.3\nvllm:kv_cache_usage_perc{engine="1"} 0.6\n'
    assert metrics.kv(page) == pytest.approx(0.6)
    assert metrics.kv("vllm:num_requests_running 1\n") is None
