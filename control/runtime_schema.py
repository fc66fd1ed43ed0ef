"""The typed `InferenceRuntime` (wakegate.io/v1alpha1): how a backend family runs on a cluster;
its CRD is generated from it (control/crd.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from wakegate.control.schema import (
    ENV_NAME_PATTERN,
    QUANTITY_PATTERN,
    Metadata,
    SecretRef,
    Spec,
    Toleration,
    backend_enum,
)

# -- InferenceRuntime (cluster-scoped, Kubernetes only) -------------------------------------------


class RuntimeProbe(Spec):
    path: str = Field(pattern=r"^/", description="HTTP path that answers 200 once the backend serves.")
    initialDelaySeconds: int = Field(0, ge=0, le=3600)
    periodSeconds: int = Field(2, ge=1, le=300)
    timeoutSeconds: int = Field(2, ge=1, le=300)
    failureThreshold: int = Field(3, ge=1, le=10000)


class RuntimeScheduling(Spec):
    nodeSelector: dict[str, str] = Field(default_factory=dict, description="Merged under the Model's own.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Added before the Model's own.")
    priorityClassName: str | None = Field(None, max_length=253)
    schedulerName: str | None = Field(None, max_length=253)


class RuntimeLifecycle(Spec):
    preStopDrainSeconds: int = Field(
        5, ge=0, le=3600, description="preStop sleep so the gateway stops routing before the backend exits."
    )
    terminationGracePeriodSeconds: int = Field(30, ge=0, le=86400)
    progressDeadlineSeconds: int = Field(
        600, ge=1, le=86400, description="Deployment progress deadline (slow model loads need a long one)."
    )


class RuntimeMetrics(Spec):
    prefix: str = Field(
        "",
        max_length=64,
        description="Prometheus metric prefix the backend exposes (vllm:, llamacpp:); empty: the engine exports "
        "no Prometheus series and its pods are not scraped.",
    )
    path: str = Field(
        "/metrics", pattern=r"^/", description="Path of the engine's metrics on its port (the backend PodMonitor's)."
    )


class InferenceRuntimeSpec(Spec):
    backend: str = Field(
        description="Backend plugin this runtime serves; Models of that backend may select it.",
        json_schema_extra=backend_enum,
    )
    image: str = Field(min_length=1, max_length=1024, description="Container image.")
    command: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list, description="Container command; empty = the image's entrypoint."
    )
    args: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list,
        description="Arguments template; {model}, {served_name}, {port} and {host} are substituted, "
        "then the Model's spec.args are appended.",
    )
    port: int = Field(8000, ge=1, le=65535, description="Port the backend listens on.")
    env: dict[Annotated[str, Field(pattern=ENV_NAME_PATTERN)], str] = Field(default_factory=dict)
    readinessProbe: RuntimeProbe
    startupProbe: RuntimeProbe | None = Field(
        None,
        description="Probed until the engine has loaded, before readiness and liveness; default: the "
        "readiness probe, with failureThreshold * periodSeconds covering lifecycle.progressDeadlineSeconds.",
    )
    livenessProbe: RuntimeProbe | None = Field(
        None, description="Restarts an engine that stops answering once loaded; none: never restarted for it."
    )
    shmSize: str = Field(
        "2Gi",
        pattern=QUANTITY_PATTERN,
        description="Size limit of the memory-backed /dev/shm (engines share tensors between processes "
        "through it); 0: none mounted.",
    )
    imagePullSecrets: list[SecretRef] = Field(
        default_factory=list, description="Secrets (in each Model's namespace) for pulling the image."
    )
    gpuVendors: list[Literal["nvidia", "amd"]] = Field(
        default_factory=list, description="Accelerator vendors this runtime supports; empty = CPU only."
    )
    acceleratorResources: dict[str, str] = Field(
        default_factory=lambda: {"nvidia": "nvidia.com/gpu", "amd": "amd.com/gpu"},
        description="Vendor -> extended resource name requested for spec.resources.gpu.count.",
    )
    gpuArch: list[Annotated[str, Field(pattern=r"^[a-z0-9]+$", max_length=32)]] = Field(default_factory=list)
    scheduling: RuntimeScheduling = Field(default_factory=RuntimeScheduling)
    lifecycle: RuntimeLifecycle = Field(default_factory=RuntimeLifecycle)
    metrics: RuntimeMetrics = Field(default_factory=RuntimeMetrics)


class InferenceRuntime(Spec):
    apiVersion: Literal["wakegate.io/v1alpha1"] = "wakegate.io/v1alpha1"
    kind: Literal["InferenceRuntime"] = "InferenceRuntime"
    metadata: Metadata
    spec: InferenceRuntimeSpec
