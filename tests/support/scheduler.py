"""Builders for the Node and Pod JSON kube-scheduler sends the extender."""

from __future__ import annotations

from typing import Any

from wakegate.control.k8s import names


def node(
    name: str,
    *,
    vendor: str | None = "nvidia",
    arch: str | None = "sm90",
    count: int | str | None = 4,
    vram: int | str | None = 81920,
    free: int | str | None = 300000,
    util: int | str | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    labels: dict[str, str] = {"kubernetes.io/hostname": name}
    for key, value in (
        (names.NODE_GPU_VENDOR, vendor),
        (names.NODE_GPU_ARCH, arch),
        (names.NODE_GPU_COUNT, count),
        (names.NODE_GPU_VRAM, vram),
    ):
        if value is not None:
            labels[key] = str(value)
    notes: dict[str, str] = dict(annotations or {})
    if free is not None:
        notes[names.NODE_GPU_FREE] = str(free)
    if util is not None:
        notes[names.NODE_GPU_UTIL] = str(util)
    return {"metadata": {"name": name, "labels": labels, "annotations": notes}}


def pod(
    name: str = "p",
    *,
    gpus: int = 1,
    resource: str = "nvidia.com/gpu",
    vram: int | str | None = 20000,
    backend: str | None = "vllm",
    model: str | None = "m1",
    tenant: str | None = None,
) -> dict[str, Any]:
    annotations: dict[str, str] = {}
    if vram is not None:
        annotations[names.ANNOTATION_VRAM_ESTIMATE] = str(vram)
    if backend is not None:
        annotations[names.ANNOTATION_BACKEND] = backend
    labels: dict[str, str] = {}
    if model is not None:
        labels[names.LABEL_MODEL] = model
    if tenant is not None:
        labels["wakegate.io/tenant"] = tenant
    resources = {"limits": {resource: str(gpus)}} if gpus else {}
    return {
        "metadata": {"name": name, "namespace": "ns", "labels": labels, "annotations": annotations},
        "spec": {"containers": [{"name": "main", "image": "x", "resources": resources}]},
    }
