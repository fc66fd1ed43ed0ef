"""GPU bookkeeping of the local runtime (pure)."""

from __future__ import annotations

from wakegate.control.gpu.discovery import GpuDevice
from wakegate.control.up.gpus import GpuPool, visible_devices_env


def device(vendor: str, arch: str = "sm90", total: int = 80_000) -> GpuDevice:
    return GpuDevice(vendor=vendor, arch=arch, name="x", total_mb=total, free_mb=total, utilization=0)


def test_devices_are_numbered_per_vendor() -> None:
    pool = GpuPool.from_devices([device("nvidia"), device("amd", "gfx942"), device("nvidia")])
    assert [(s.vendor, s.index) for s in pool.slots] == [("nvidia", 0), ("amd", 0), ("nvidia", 1)]


def test_allocate_release_and_cap() -> None:
    pool = GpuPool.from_devices([device("nvidia"), device("nvidia")])
    first = pool.allocate("m#0", 1, ("nvidia", "amd"))
    second = pool.allocate("m#1", 1, ("nvidia", "amd"))
    assert first and second and first != second
    assert pool.allocate("m#2", 1, ("nvidia",)) is None  # capped at what the machine holds
    assert visible_devices_env(second) == {"CUDA_VISIBLE_DEVICES": "1"}
    pool.release("m#0")
    assert pool.allocate("m#2", 1, ("nvidia",)) == first


def test_vendor_vram_and_multi_gpu() -> None:
    pool = GpuPool.from_devices([device("nvidia", total=24_000), device("amd", "gfx942"), device("amd", "gfx942")])
    assert pool.allocate("big", 1, ("nvidia", "amd"), min_vram_mb=40_000) is not None  # an AMD one fits
    assert pool.allocate("pair", 2, ("nvidia", "amd")) is None  # one AMD left, one small NVIDIA
    both = GpuPool.from_devices([device("amd", "gfx942"), device("amd", "gfx942")]).allocate("p", 2, ("amd",))
    assert both is not None and visible_devices_env(both) == {"HIP_VISIBLE_DEVICES": "0,1"}


def test_no_gpu_work_needs_nothing() -> None:
    assert GpuPool().allocate("cpu", 0, ()) == []
    assert GpuPool().allocate("gpu", 1, ("nvidia",)) is None
