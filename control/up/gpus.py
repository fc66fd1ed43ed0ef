"""Accelerators for local backends: which GPUs a replica gets, as CUDA/HIP visible-device lists.

Discovery happens once when `wakegate up` starts (NVML and amdsmi when importable, nothing
otherwise, or a fake file for tests and demos). Allocation is pure bookkeeping: a replica
takes whole devices of one vendor and gives them back when it stops; when too few are free,
the replica does not start, which caps a model's replicas at what the machine holds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from wakegate.control.gpu.discovery import Discovery, DiscoveryError, GpuDevice, probe

log = logging.getLogger("wakegate.up")

VISIBLE_DEVICES_ENV = {"nvidia": "CUDA_VISIBLE_DEVICES", "amd": "HIP_VISIBLE_DEVICES"}


@dataclass(frozen=True, slots=True)
class Slot:
    vendor: str
    #: Index among this vendor's devices, as the vendor runtime numbers them.
    index: int
    arch: str
    total_mb: int


@dataclass
class GpuPool:
    slots: list[Slot] = field(default_factory=list)
    _taken: dict[Slot, str] = field(default_factory=dict)
    #: Owners whose engine sleeps: the devices they will want back, and the MiB each keeps there.
    _dozing: dict[str, tuple[list[Slot], int]] = field(default_factory=dict)

    def doze(self, owner: str, keeps_mb: int = 0) -> None:
        """`owner`'s engine sleeps: its devices are free for others, less the `keeps_mb` it keeps."""
        slots = [s for s, o in self._taken.items() if o == owner]
        for slot in slots:
            del self._taken[slot]
        if slots:
            self._dozing[owner] = (slots, keeps_mb)

    def rouse(self, owner: str) -> bool:
        """`owner`'s engine wakes: take its devices back; False when another owner holds one."""
        slots, keeps = self._dozing.pop(owner, ([], 0))
        if any(s in self._taken for s in slots):
            self._dozing[owner] = (slots, keeps)
            return False
        for slot in slots:
            self._taken[slot] = owner
        return True

    def _kept_mb(self, slot: Slot) -> int:
        return sum(keeps for slots, keeps in self._dozing.values() if slot in slots)

    @classmethod
    def from_devices(cls, devices: list[GpuDevice]) -> GpuPool:
        per_vendor: dict[str, int] = {}
        slots = []
        for device in devices:
            index = per_vendor.get(device.vendor, 0)
            per_vendor[device.vendor] = index + 1
            slots.append(Slot(device.vendor, index, device.arch, device.total_mb))
        return cls(slots)

    @property
    def free(self) -> list[Slot]:
        return [s for s in self.slots if s not in self._taken]

    def allocate(
        self, owner: str, count: int, vendors: tuple[str, ...], vendor: str | None = None, min_vram_mb: int = 0
    ) -> list[Slot] | None:
        """Take `count` free devices of one acceptable vendor; None when they are not there."""
        if count <= 0:
            return []
        acceptable = (vendor,) if vendor else vendors
        for candidate in acceptable:
            free = [s for s in self.free if s.vendor == candidate and s.total_mb - self._kept_mb(s) >= min_vram_mb]
            if len(free) >= count:
                chosen = free[:count]
                for slot in chosen:
                    self._taken[slot] = owner
                return chosen
        return None

    def owned(self, owner: str) -> list[str]:
        return [f"{s.vendor}:{s.index}" for s, o in self._taken.items() if o == owner]

    def release(self, owner: str) -> None:
        for slot in [s for s, o in self._taken.items() if o == owner]:
            del self._taken[slot]
        self._dozing.pop(owner, None)


def visible_devices_env(slots: list[Slot]) -> dict[str, str]:
    if not slots:
        return {}
    variable = VISIBLE_DEVICES_ENV[slots[0].vendor]
    return {variable: ",".join(str(s.index) for s in slots)}


def discover(fake_file: Path | None = None) -> GpuPool:
    """This machine's GPUs; an empty pool (and one log line) when there are none or no library."""
    discoveries: list[Discovery]
    if fake_file is not None:
        from wakegate.control.gpu.fake import FakeDiscovery

        discoveries, problems = [FakeDiscovery(fake_file, "*")], list[str]()
    else:
        discoveries, problems = probe()
    devices: list[GpuDevice] = []
    for discovery in discoveries:
        try:
            devices += discovery.devices()
        except DiscoveryError as exc:
            problems.append(f"{discovery.name}: {exc}")
        finally:
            discovery.close()
    if devices:
        log.info("gpus found count=%d %s", len(devices), " ".join(f"{d.vendor}:{d.arch}" for d in devices))
    else:
        log.info("no GPUs: backends run without accelerators (%s)", "; ".join(problems) or "no devices")
    return GpuPool.from_devices(devices)
