"""Accelerator discovery: NVML and amdsmi code paths driven by fake libraries, the fake file, probe.

`test_real_nvml_*` runs the real NVML path and skips unless `pynvml.nvmlInit()` succeeds
(a machine with an NVIDIA driver and GPU).
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest

from wakegate.control.gpu.amd import AmdDiscovery
from wakegate.control.gpu.discovery import DiscoveryError, GpuDevice, probe
from wakegate.control.gpu.fake import FakeDiscovery
from wakegate.control.gpu.nvml import NvmlDiscovery

GIB = 1024**3


class FakeNVMLError(Exception):
    pass


def fake_nvml(*, init_fails: bool = False, util_fails: bool = False) -> Any:
    calls: list[str] = []

    def init() -> None:
        calls.append("init")
        if init_fails:
            raise FakeNVMLError("Driver Not Loaded")

    def util(_h: int) -> Any:
        if util_fails:
            raise FakeNVMLError("Not Supported")
        return types.SimpleNamespace(gpu=37, memory=5)

    return types.SimpleNamespace(
        calls=calls,
        NVMLError=FakeNVMLError,
        nvmlInit=init,
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: b"NVIDIA H100 80GB HBM3" if h == 0 else "NVIDIA H100 80GB HBM3",
        nvmlDeviceGetCudaComputeCapability=lambda h: (9, 0),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=80 * GIB, free=(70 - h) * GIB, used=0),
        nvmlDeviceGetUtilizationRates=util,
    )


def test_nvml_path_with_a_fake_library() -> None:
    nvml = fake_nvml()
    discovery = NvmlDiscovery(nvml)
    devices = discovery.devices()
    assert devices == [
        GpuDevice("nvidia", "sm90", "NVIDIA H100 80GB HBM3", 81920, 71680, 37.0),
        GpuDevice("nvidia", "sm90", "NVIDIA H100 80GB HBM3", 81920, 70656, 37.0),
    ]
    discovery.close()
    assert nvml.calls == ["init", "shutdown"]


def test_nvml_without_driver_is_a_discovery_error() -> None:
    with pytest.raises(DiscoveryError, match="nvmlInit failed: Driver Not Loaded"):
        NvmlDiscovery(fake_nvml(init_fails=True))


def test_nvml_utilization_not_supported_counts_as_idle() -> None:
    assert NvmlDiscovery(fake_nvml(util_fails=True)).devices()[0].utilization == 0.0


class FakeSmiError(Exception):
    pass


def fake_amdsmi(*, init_fails: bool = False) -> Any:
    def init() -> None:
        if init_fails:
            raise FakeSmiError("AMDSMI_STATUS_INIT_ERROR")

    return types.SimpleNamespace(
        AmdSmiException=FakeSmiError,
        AmdSmiMemoryType=types.SimpleNamespace(VRAM="vram"),
        amdsmi_init=init,
        amdsmi_shut_down=lambda: None,
        amdsmi_get_processor_handles=lambda: ["h0"],
        amdsmi_get_gpu_asic_info=lambda h: {"market_name": "AMD Instinct MI300X", "target_graphics_version": "gfx942"},
        amdsmi_get_gpu_memory_total=lambda h, t: 192 * GIB,
        amdsmi_get_gpu_memory_usage=lambda h, t: 2 * GIB,
        amdsmi_get_gpu_activity=lambda h: {"gfx_activity": 12, "umc_activity": 0, "mm_activity": 0},
    )


def test_amdsmi_path_with_a_fake_library() -> None:
    discovery = AmdDiscovery(fake_amdsmi())
    assert discovery.devices() == [GpuDevice("amd", "gfx942", "AMD Instinct MI300X", 196608, 194560, 12.0)]
    discovery.close()
    with pytest.raises(DiscoveryError, match="amdsmi_init failed"):
        AmdDiscovery(fake_amdsmi(init_fails=True))


def test_amdsmi_not_installed_is_a_discovery_error() -> None:
    try:
        import amdsmi  # noqa: F401
    except ImportError:
        with pytest.raises(DiscoveryError, match="amdsmi not importable"):
            AmdDiscovery()
    else:
        pytest.skip("amdsmi is installed here")


def test_probe_collects_what_opens_and_why_the_rest_did_not() -> None:
    def broken() -> Any:
        raise DiscoveryError("no driver")

    opened, problems = probe((("good", lambda: NvmlDiscovery(fake_nvml())), ("bad", broken)))
    assert [d.name for d in opened] == ["nvml"]
    assert problems == ["bad: no driver"]


def test_default_probe_never_raises() -> None:
    opened, problems = probe()
    assert len(opened) + len(problems) == 2
    for discovery in opened:
        discovery.close()


def test_fake_file(tmp_path: Path) -> None:
    path = tmp_path / "gpus.json"
    gpu = {"vendor": "amd", "arch": "gfx1100", "total_mb": 24576, "free_mb": 20000, "utilization": 3}
    path.write_text(json.dumps({"n1": [gpu, gpu], "*": []}))
    assert len(FakeDiscovery(path, "n1").devices()) == 2
    assert FakeDiscovery(path, "other").devices() == []
    path.write_text(json.dumps({"n1": [{"vendor": "amd", "arch": "gfx1100"}]}))
    with pytest.raises(DiscoveryError, match="total_mb"):
        FakeDiscovery(path, "n1").devices()
    path.write_text("not json")
    with pytest.raises(DiscoveryError, match="cannot read"):
        FakeDiscovery(path, "n1").devices()


def _nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.mark.skipif(not _nvml_works(), reason="no NVIDIA driver/GPU here: pynvml.nvmlInit() fails")
def test_real_nvml_reports_this_machines_gpus() -> None:
    discovery = NvmlDiscovery()
    try:
        devices = discovery.devices()
    finally:
        discovery.close()
    assert devices, "NVML initialised but reported no device"
    for device in devices:
        assert device.vendor == "nvidia"
        assert device.arch.startswith("sm") and device.arch[2:].isdigit()
        assert device.total_mb > 0 and 0 <= device.free_mb <= device.total_mb
        assert 0 <= device.utilization <= 100
