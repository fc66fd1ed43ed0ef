"""NVIDIA GPUs through NVML (`pynvml` from nvidia-ml-py).

The module is passed in (default: the real `pynvml`) so tests drive this exact code with a
fake NVML; a machine with an NVIDIA driver runs it for real (tests/control/gpu/test_gpu.py,
`test_real_nvml_reports_this_machines_gpus`).
"""

from __future__ import annotations

from typing import Any

from wakegate.control.gpu.discovery import DiscoveryError, GpuDevice

MIB = 1024 * 1024


def _load() -> Any:
    try:
        import pynvml
    except ImportError as exc:
        raise DiscoveryError(f"pynvml not importable ({exc}); install nvidia-ml-py") from None
    return pynvml


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


class NvmlDiscovery:
    name = "nvml"

    def __init__(self, nvml: Any = None) -> None:
        self.nvml: Any = nvml if nvml is not None else _load()
        try:
            self.nvml.nvmlInit()
        except self.nvml.NVMLError as exc:
            raise DiscoveryError(f"nvmlInit failed: {exc} (no NVIDIA driver or GPU)") from None

    def _device(self, index: int) -> GpuDevice:
        nvml = self.nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            utilization = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except nvml.NVMLError:
            # Some devices (MIG instances, some vGPUs) do not report utilization.
            utilization = 0.0
        return GpuDevice(
            vendor="nvidia",
            arch=f"sm{major}{minor}",
            name=_text(nvml.nvmlDeviceGetName(handle)),
            total_mb=int(memory.total) // MIB,
            free_mb=int(memory.free) // MIB,
            utilization=utilization,
        )

    def devices(self) -> list[GpuDevice]:
        try:
            return [self._device(i) for i in range(self.nvml.nvmlDeviceGetCount())]
        except self.nvml.NVMLError as exc:
            raise DiscoveryError(f"NVML query failed: {exc}") from None

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            return
