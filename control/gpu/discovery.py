"""The discovery seam: what a vendor library tells about this machine's GPUs, and probing for them.

A :class:`Discovery` lists the GPUs as :class:`GpuDevice` values; :func:`probe` opens every
vendor library that works here and explains the ones that do not.
"""


from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class DiscoveryError(Exception):
    """The vendor library or its driver is missing or refused to answer."""


@dataclass(frozen=True)
class GpuDevice:
    vendor: str
    #: `sm<major><minor>` (NVIDIA compute capability) or `gfx…` (AMD target)
    arch: str
    name: str
    total_mb: int
    free_mb: int
    #: percent 0..100
    utilization: float


class Discovery(Protocol):
    name: str

    def devices(self) -> list[GpuDevice]:
        """The GPUs now; raises DiscoveryError when the library stops answering."""
        ...

    def close(self) -> None: ...


def _nvml() -> Discovery:
    from wakegate.control.gpu.nvml import NvmlDiscovery

    return NvmlDiscovery()


def _amd() -> Discovery:
    from wakegate.control.gpu.amd import AmdDiscovery

    return AmdDiscovery()


OPENERS: tuple[tuple[str, Callable[[], Discovery]], ...] = (("nvml", _nvml), ("amdsmi", _amd))


def probe(openers: tuple[tuple[str, Callable[[], Discovery]], ...] = OPENERS) -> tuple[list[Discovery], list[str]]:
    """Every vendor library that opens, and one line per library that did not (and why)."""
    opened: list[Discovery] = []
    problems: list[str] = []
    for name, opener in openers:
        try:
            opened.append(opener())
        except DiscoveryError as exc:
            problems.append(f"{name}: {exc}")
    return opened, problems
