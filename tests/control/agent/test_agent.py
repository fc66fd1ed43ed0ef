"""The node agent: what it writes for which GPUs, patching only changes, no crash without GPUs."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from tests.support.fakekube import FakeApiServer
from wakegate.control.agent.labels import Report, node_report, patch_for
from wakegate.control.agent.main import NodeAgent
from wakegate.control.gpu.discovery import DiscoveryError, GpuDevice
from wakegate.control.gpu.fake import FakeDiscovery

H100 = GpuDevice("nvidia", "sm90", "H100", 81559, 80000, 10.0)


def test_report_for_a_uniform_node() -> None:
    report = node_report([H100, GpuDevice("nvidia", "sm90", "H100", 81559, 1000, 31.0)])
    assert report.labels == {
        "wakegate.io/gpu.vendor": "nvidia",
        "wakegate.io/gpu.arch": "sm90",
        "wakegate.io/gpu.count": "2",
        "wakegate.io/gpu.vram-mb": "81559",
    }
    assert report.annotations == {"wakegate.io/gpu-free-memory-mb": "81000", "wakegate.io/gpu-utilization": "20"}


def test_report_for_a_mixed_node_describes_the_largest_group() -> None:
    small = GpuDevice("nvidia", "sm86", "A10", 24000, 24000, 0.0)
    report = node_report([small, H100, H100])
    assert report.labels["wakegate.io/gpu.arch"] == "sm90" and report.labels["wakegate.io/gpu.count"] == "2"


def test_report_without_gpus_is_empty_and_arch_is_label_safe() -> None:
    assert node_report([]) == Report({}, {})
    odd = GpuDevice("amd", "GFX 942:sramecc+", "x", 1, 1, 0.0)
    assert node_report([odd]).labels["wakegate.io/gpu.arch"] == "gfx942sramecc"


def test_patch_only_changed_keys_and_removes_stale_ones() -> None:
    report = node_report([H100])
    assert patch_for(report, dict(report.labels), dict(report.annotations)) is None
    changed = dict(report.annotations, **{"wakegate.io/gpu-utilization": "99"})
    assert patch_for(report, dict(report.labels), changed) == {
        "metadata": {"annotations": {"wakegate.io/gpu-utilization": "10"}}
    }
    stale = {"wakegate.io/gpu.vendor": "amd", "other": "keep"}
    patch = patch_for(Report({}, {}), stale, {"wakegate.io/gpu-utilization": "5"})
    assert patch == {
        "metadata": {"labels": {"wakegate.io/gpu.vendor": None}, "annotations": {"wakegate.io/gpu-utilization": None}}
    }


NODE = "/api/v1/nodes/n"


def node_server(labels: dict[str, str] | None = None) -> FakeApiServer:
    """The API server with one Node, n (the real one runs in e2e/test_placement.py)."""
    server = FakeApiServer()
    server.add(NODE, {"metadata": {"name": "n", "labels": dict(labels or {})}})
    return server


def patches(server: FakeApiServer) -> list[Any]:
    """The agent's merge patches, each of Node n as wakegate-agent."""
    calls = server.writes("PATCH")
    assert all(c.path == NODE and c.query["fieldManager"] == "wakegate-agent" for c in calls)
    return [c.body for c in calls]


def test_agent_patches_on_change_only(tmp_path: Path) -> None:
    path = tmp_path / "gpus.json"
    gpu = {"vendor": "nvidia", "arch": "sm90", "total_mb": 81559, "free_mb": 80000, "utilization": 0}
    path.write_text(json.dumps({"n": [gpu]}))
    core = node_server()
    agent = NodeAgent(core.kube(), "n", [FakeDiscovery(path, "n")], [])
    assert agent.sync() is True
    assert agent.sync() is False
    path.write_text(json.dumps({"n": [dict(gpu, free_mb=1000)]}))
    assert agent.sync() is True
    assert patches(core)[-1] == {"metadata": {"annotations": {"wakegate.io/gpu-free-memory-mb": "1000"}}}
    path.write_text(json.dumps({"n": []}))
    assert agent.sync() is True
    assert patches(core)[-1]["metadata"]["labels"] == dict.fromkeys(
        ("wakegate.io/gpu.vendor", "wakegate.io/gpu.arch", "wakegate.io/gpu.count", "wakegate.io/gpu.vram-mb")
    )
    assert agent.sync() is False


class Broken:
    name = "nvml"

    def devices(self) -> list[GpuDevice]:
        raise DiscoveryError("NVML query failed: GPU is lost")

    def close(self) -> None:
        return


def test_no_gpu_and_no_library_log_one_clear_line(caplog: pytest.LogCaptureFixture) -> None:
    core = node_server()
    agent = NodeAgent(core.kube(), "n", [Broken()], ["amdsmi: amdsmi not importable"])
    with caplog.at_level(logging.INFO, logger="wakegate.agent"):
        assert agent.sync() is False
        assert agent.sync() is False
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "node n: no GPU found (amdsmi: amdsmi not importable; nvml: NVML query failed: GPU is lost); "
        "the node gets no wakegate GPU labels"
    ]
    assert patches(core) == []


def test_stale_labels_from_an_earlier_run_are_removed() -> None:
    core = node_server({"wakegate.io/gpu.vendor": "nvidia", "kubernetes.io/os": "linux"})
    assert NodeAgent(core.kube(), "n", [], ["nvml: nvmlInit failed"]).sync() is True
    assert patches(core) == [{"metadata": {"labels": {"wakegate.io/gpu.vendor": None}}}]


def test_cli_without_node_name_fails_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    from wakegate.cli import main

    monkeypatch.delenv("NODE_NAME", raising=False)
    assert main(["agent", "--once"]) == 2
