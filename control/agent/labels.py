"""What the GPU node agent writes on its Node, from the GPUs it found. Pure: no I/O.

Labels `wakegate.io/gpu.vendor`, `gpu.arch`, `gpu.count`, `gpu.vram-mb` (per GPU, MiB) and
annotations `wakegate.io/gpu-free-memory-mb` (summed over the GPUs) and
`wakegate.io/gpu-utilization` (mean percent); only keys whose value changed are patched.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from wakegate.control.gpu.discovery import GpuDevice
from wakegate.control.k8s import names

LABELS = (names.NODE_GPU_VENDOR, names.NODE_GPU_ARCH, names.NODE_GPU_COUNT, names.NODE_GPU_VRAM)
ANNOTATIONS = (names.NODE_GPU_FREE, names.NODE_GPU_UTIL)


def _label_value(text: str) -> str:
    """Lower-case alphanumerics only: always a valid label value (arch strings come from drivers)."""
    return "".join(c for c in text.lower() if c.isalnum())[:63] or "unknown"


@dataclass(frozen=True)
class Report:
    """What the node should carry; empty dicts mean "no GPU": remove ours."""

    labels: dict[str, str]
    annotations: dict[str, str]


def node_report(devices: Sequence[GpuDevice]) -> Report:
    """Labels and annotations for these GPUs.

    A node mixing GPU models is described by its largest group of one vendor and arch (first
    seen wins a tie); count, VRAM, free memory and utilization cover that group only.
    """
    if not devices:
        return Report({}, {})
    groups = Counter((d.vendor, d.arch) for d in devices)
    vendor, arch = max(groups, key=lambda key: groups[key])
    group = [d for d in devices if (d.vendor, d.arch) == (vendor, arch)]
    return Report(
        labels={
            names.NODE_GPU_VENDOR: _label_value(vendor),
            names.NODE_GPU_ARCH: _label_value(arch),
            names.NODE_GPU_COUNT: str(len(group)),
            names.NODE_GPU_VRAM: str(min(d.total_mb for d in group)),
        },
        annotations={
            names.NODE_GPU_FREE: str(sum(d.free_mb for d in group)),
            names.NODE_GPU_UTIL: str(round(sum(d.utilization for d in group) / len(group))),
        },
    )


def patch_for(
    report: Report,
    labels: dict[str, str],
    annotations: dict[str, str],
    annotation_keys: Sequence[str] = ANNOTATIONS,
) -> dict[str, Any] | None:
    """The merge patch from the node's current labels/annotations to the report; None: nothing to do.

    Only `LABELS` and `annotation_keys` are the agent's: others on the Node are never touched.
    """
    meta: dict[str, dict[str, str | None]] = {}
    for part, keys, want, have in (
        ("labels", LABELS, report.labels, labels),
        ("annotations", annotation_keys, report.annotations, annotations),
    ):
        changes: dict[str, str | None] = {}
        for key in keys:
            if want.get(key) != have.get(key):
                changes[key] = want.get(key)
        if changes:
            meta[part] = changes
    return {"metadata": meta} if meta else None
