"""The InferenceRuntime objects wakegate ships, derived from the backend plugins (control/backends/).

One runtime per image an engine's makers publish: `llamacpp` (CPU), `llamacpp-cuda`,
`llamacpp-rocm`, … A runtime claims exactly the vendor its image is built for, so the operator
never puts a CUDA image on an AMD node. Engines without a published image (MLC LLM, ComfyUI,
diffusers) ship no runtime: a Model of theirs names the user's own with `spec.runtimeRef`.
`wakegate operator --install-runtimes` applies these.
"""

from __future__ import annotations

from typing import Any

from wakegate.control.backends import BACKENDS, Backend, Image
from wakegate.control.schema import API_VERSION

#: Label marking the runtimes wakegate ships (users' own runtimes lack it).
LABEL_SHIPPED = "wakegate.io/shipped"
#: An engine's private folder inside its own container (Ollama's model store).
POD_STATE = "/tmp/wakegate-engine"  # noqa: S108 - the container's own /tmp, no other user


def _command(backend: Backend, image: Image) -> tuple[list[str], list[str]]:
    """(command, args) templates for the container."""
    if image.reference.endswith("/wakegate/sim:latest"):
        # The simulator image's entrypoint is `wakegate sim --host <pod IP> --port <port>`.
        return [], ["--served-model-name", "{served_name}"]
    if backend.container_command:
        return list(backend.container_command), list(backend.container_args)
    program = list(image.program or backend.program)
    args = [a.replace("{host}", "0.0.0.0") for a in backend.args]
    return program, args


def runtime_name(backend: Backend, image: Image) -> str:
    return f"{backend.name}-{image.suffix}" if image.suffix else backend.name


def runtime_for(backend: Backend, image: Image) -> dict[str, Any]:
    command, args = _command(backend, image)
    env = {k: v.replace("{host}", "0.0.0.0").replace("{state}", POD_STATE) for k, v in backend.env.items()}
    gpu = image.vendor != "cpu"
    return {
        "apiVersion": API_VERSION,
        "kind": "InferenceRuntime",
        "metadata": {"name": runtime_name(backend, image), "labels": {LABEL_SHIPPED: "true"}},
        "spec": {
            "backend": backend.name,
            "image": image.reference,
            "command": command,
            "args": args,
            "port": backend.default_port,
            "env": env,
            "readinessProbe": {"path": readiness_path(backend), "periodSeconds": 2, "failureThreshold": 3},
            # Once loaded (the startup probe, derived from readiness, waits out the load), an engine
            # whose health path stops answering for a minute is restarted.
            "livenessProbe": {
                "path": backend.health_path,
                "periodSeconds": 10,
                "timeoutSeconds": 5,
                "failureThreshold": 6,
            },
            "gpuVendors": [image.vendor] if gpu else [],
            "gpuArch": list(backend.gpu_arch) if gpu else [],
            "lifecycle": {
                "preStopDrainSeconds": 5 if gpu else 1,
                "terminationGracePeriodSeconds": 30,
                "progressDeadlineSeconds": 1800 if gpu else 600,
            },
            "metrics": {"prefix": backend.metrics_prefix, "path": backend.metrics_path or "/metrics"},
        },
    }


def readiness_path(backend: Backend) -> str:
    """The HTTP path a kubelet probes. Ollama's `/api/ps` lists loaded models but always answers
    200, so on a cluster the model's own `/v1/models/{served_name}` (404 until it is created) is
    the check; every other engine's health path already means "loaded"."""
    if backend.prepare:
        return f"{backend.openai_prefix}/models/{{served_name}}"
    return backend.health_path


def shipped_runtimes() -> list[dict[str, Any]]:
    return [runtime_for(backend, image) for backend in BACKENDS.values() for image in backend.images]
