"""AMD GPUs through `amdsmi` (ROCm's AMD SMI Python bindings), used only when importable.

`amdsmi` ships with ROCm, not on PyPI for every platform, so it is not a dependency: without
it this discovery reports why and the agent carries on. The module is injectable for tests.
"""

from __future__ import annotations

from typing import Any

from wakegate.control.gpu.discovery import DiscoveryError, GpuDevice

MIB = 1024 * 1024


def _load() -> Any:
    try:
        import amdsmi
    except ImportError as exc:
        raise DiscoveryError(f"amdsmi not importable ({exc}); it ships with ROCm") from None
    return amdsmi


class AmdDiscovery:
    name = "amdsmi"

    def __init__(self, smi: Any = None) -> None:
        self.smi: Any = smi if smi is not None else _load()
        try:
            self.smi.amdsmi_init()
        except self.smi.AmdSmiException as exc:
            raise DiscoveryError(f"amdsmi_init failed: {exc} (no amdgpu driver or GPU)") from None

    def _device(self, handle: Any) -> GpuDevice:
        smi = self.smi
        asic = smi.amdsmi_get_gpu_asic_info(handle)
        vram = smi.AmdSmiMemoryType.VRAM
        total = int(smi.amdsmi_get_gpu_memory_total(handle, vram))
        used = int(smi.amdsmi_get_gpu_memory_usage(handle, vram))
        try:
            utilization = float(smi.amdsmi_get_gpu_activity(handle)["gfx_activity"])
        except (smi.AmdSmiException, KeyError, TypeError, ValueError):
            utilization = 0.0
        arch = str(asic.get("target_graphics_version") or "unknown").lower()
        return GpuDevice(
            vendor="amd",
            arch=arch,
            name=str(asic.get("market_name") or "AMD GPU"),
            total_mb=total // MIB,
            free_mb=max(0, total - used) // MIB,
            utilization=utilization,
        )

    def devices(self) -> list[GpuDevice]:
        try:
            return [self._device(h) for h in self.smi.amdsmi_get_processor_handles()]
        except self.smi.AmdSmiException as exc:
            raise DiscoveryError(f"amdsmi query failed: {exc}") from None

    def close(self) -> None:
        try:
            self.smi.amdsmi_shut_down()
        except self.smi.AmdSmiException:
            return
