"""The InferenceRuntime objects wakegate ships: one per backend plugin, derived from control/backends.py.

A runtime is the cluster form of a plugin: image, argument template, port,
readiness probe, accelerators, lifecycle. `wakegate operator --install-runtimes`
applies these; users may add their own (e.g. a pinned image) and select them
with a Model's `spec.runtimeRef`.
"""

from __future__ import annotations

from typing import Any

from wakegate.control.backends import BACKENDS, Backend
from wakegate.control.schema import API_VERSION

#: Label marking the runtimes wakegate ships (users' own runtimes lack it).
LABEL_SHIPPED = "wakegate.io/shipped"


def _args(backend: Backend) -> tuple[list[str], list[str]]:
    """(command, args) templates for the container, from the plugin's command."""
    rendered = list(backend.command)
    if backend.image.endswith("/wakegate/sim:latest"):
        # The simulator image's entrypoint is `wakegate sim --host <pod IP> --port <port>`.
        return [], ["--served-model-name", "{served_name}"]
    return rendered[:1], rendered[1:]


def runtime_for(backend: Backend) -> dict[str, Any]:
    command, args = _args(backend)
    return {
        "apiVersion": API_VERSION,
        "kind": "InferenceRuntime",
        "metadata": {"name": backend.name, "labels": {LABEL_SHIPPED: "true"}},
        "spec": {
            "backend": backend.name,
            "image": backend.image,
            "command": command,
            "args": args,
            "port": backend.default_port,
            "env": dict(backend.env),
            "readinessProbe": {"path": backend.health_path, "periodSeconds": 2, "failureThreshold": 3},
            "gpuVendors": list(backend.gpu_vendors),
            "gpuArch": list(backend.gpu_arch),
            "lifecycle": {
                "preStopDrainSeconds": 1 if not backend.gpu_vendors else 5,
                "terminationGracePeriodSeconds": 30,
                "progressDeadlineSeconds": 600 if not backend.gpu_vendors else 1800,
            },
            "metrics": {"prefix": backend.metrics_prefix, "path": "/metrics"},
        },
    }


def shipped_runtimes() -> list[dict[str, Any]]:
    return [runtime_for(backend) for backend in BACKENDS.values()]
