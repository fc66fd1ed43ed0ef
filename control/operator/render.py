"""Pure rendering: (Model, InferenceRuntime, settings) -> the Kubernetes objects that serve the model.

Plain dicts in, plain dicts out, no I/O. The operator applies the result with
server-side apply under one field manager; what is not rendered any more is
pruned by the API server (field ownership) or by the operator (whole objects,
see `PRUNABLE_KINDS`). Runtime selection lives here too: explicit `runtimeRef`,
else the best runtime for the Model's backend and GPU vendor.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from wakegate.control.backends import BACKENDS
from wakegate.control.backends.base import kv_events_argv
from wakegate.control.delivery.index import dirname
from wakegate.control.k8s import names
from wakegate.control.k8s.adapters import (
    ANNOTATION_ADAPTERS,
    GATE_ADAPTERS,
    SourceUnsupported,
    adapter_mount,
    source_mount,
)
from wakegate.control.k8s.objects import model_from_object, runtime_from_object
from wakegate.control.runtime_schema import InferenceRuntime, RuntimeProbe
from wakegate.control.runtimes import LABEL_SHIPPED, shipped_runtimes
from wakegate.control.scaling.core import policy_of
from wakegate.control.schema import LoRAAdapter, Model, ScalingEngine

if TYPE_CHECKING:
    from wakegate.control.operator.weights import Weights

KEDA_API_VERSION = "keda.sh/v1alpha1"
#: Owned kinds that come and go with the spec (`max`, `engine`); the operator deletes them when
#: they are no longer rendered. Service and Deployment are never pruned: without KEDA a running
#: keda-engine backend is kept rather than cut off while it serves.
PRUNABLE_KINDS: tuple[tuple[str, str], ...] = (
    ("policy/v1", "PodDisruptionBudget"),
    (KEDA_API_VERSION, "ScaledObject"),
    (KEDA_API_VERSION, "TriggerAuthentication"),
    (names.API_VERSION, "ModelCache"),
)
#: KEDA kinds: without KEDA's CRDs installed they are neither applied nor pruned.
KEDA_KINDS = frozenset({"ScaledObject", "TriggerAuthentication"})
#: Keys of the KEDA client Secret (`--keda-auth-secret`), as a `kubernetes.io/tls` Secret plus
#: `ca.crt` holds them, and the external scaler's auth parameters they fill.
KEDA_AUTH_KEYS: tuple[tuple[str, str], ...] = (
    ("caCert", "ca.crt"),
    ("tlsClientCert", "tls.crt"),
    ("tlsClientKey", "tls.key"),
)
WEIGHTS_VOLUME = "weights"
SHM_VOLUME = "dshm"
WEIGHTS_ROOT = "/models"
#: Where a pod sees its node-cache entry (read-only): `files/` holds the model's files.
CACHE_MOUNT = f"{WEIGHTS_ROOT}/cache"


class RenderError(ValueError):
    """The Model cannot be rendered; `reason` is a condition reason, the message says why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Settings:
    """Cluster-wide knobs of the operator (flags of `wakegate operator`)."""

    #: host:port of the KEDA external-push scaler (`wakegate scaler`).
    scaler_address: str = "wakegate-scaler.wakegate-system.svc:9091"
    #: Whether the ScaledObject CRD is installed (observed, not configured).
    keda_available: bool = True
    #: The node agents' model cache directory on every node (the agent DaemonSet's hostPath).
    node_cache_dir: str = names.NODE_CACHE_DIR
    #: Secret (in each Model's namespace) with KEDA's client certificate for the scaler's mTLS
    #: (`tls.crt`, `tls.key`, `ca.crt`); None: KEDA dials the scaler in plaintext.
    keda_auth_secret: str | None = None
    #: Models may take the native path (`--native-path`, as the feeder's): what status.routingPath
    #: says of a Model that asks for it.
    native_path: bool = False


@dataclass(frozen=True)
class Condition:
    type: str
    status: str
    reason: str
    message: str = ""


@dataclass(frozen=True)
class Rendered:
    """What to apply for one Model, and what the rendering itself says about autoscaling."""

    objects: list[dict[str, Any]]
    autoscaling: Condition
    runtime: str
    conditions: list[Condition] = field(default_factory=list)

    def digest(self) -> str:
        """Content hash of the objects: equal renders need no new apply."""
        return hashlib.blake2b(json.dumps(self.objects, sort_keys=True).encode(), digest_size=12).hexdigest()


def parse_runtime(body: Mapping[str, Any]) -> InferenceRuntime | None:
    """An InferenceRuntime object parsed, or None when it is invalid (`select_runtime` skips it)."""
    try:
        return runtime_from_object(body)
    except ValidationError:
        return None


def never_reconciled(body: Mapping[str, Any]) -> bool:
    """Whether no operator has finished a reconcile of this Model yet: its first generation, and no
    `observedGeneration` in its status (every reconcile writes one). Whatever an operator that
    stopped mid-way applied for it came from this same spec, so it renders the same kinds now
    and nothing needs pruning: a new Model is spared a DELETE per prunable kind."""
    status = body.get("status") or {}
    return int((body.get("metadata") or {}).get("generation", 1) or 1) <= 1 and "observedGeneration" not in status


@functools.cache
def _shipped() -> tuple[InferenceRuntime, ...]:
    """The shipped runtimes, parsed once per process (they never change while it runs)."""
    return tuple(runtime_from_object(body) for body in shipped_runtimes())


def select_runtime(model: Model, runtimes: Iterable[Mapping[str, Any] | InferenceRuntime]) -> InferenceRuntime:
    """Explicit `runtimeRef`, else the best runtime for backend + GPU vendor (shipped before user's).

    `runtimes` are the cluster's InferenceRuntime objects (as bodies, or already parsed: the
    operator parses each once per watch event); the shipped ones are the fallback when the
    cluster has none for the backend.
    """
    parsed: dict[str, InferenceRuntime] = {}
    for body in runtimes:
        if isinstance(body, InferenceRuntime):
            parsed[body.metadata.name] = body
            continue
        try:
            runtime = runtime_from_object(body)
        except ValidationError:
            continue
        parsed[runtime.metadata.name] = runtime
    spec = model.spec
    if spec.runtimeRef is not None:
        chosen = parsed.get(spec.runtimeRef.name)
        if chosen is None:
            raise RenderError("RuntimeNotFound", f"InferenceRuntime {spec.runtimeRef.name!r} does not exist")
        if chosen.spec.backend != spec.backend:
            raise RenderError(
                "RuntimeMismatch",
                f"InferenceRuntime {chosen.metadata.name!r} serves backend {chosen.spec.backend!r}, "
                f"not {spec.backend!r}",
            )
        return chosen
    for shipped in _shipped():
        parsed.setdefault(shipped.metadata.name, shipped)
    vendor = spec.resources.gpu.vendor
    candidates = [r for r in parsed.values() if r.spec.backend == spec.backend]
    gpu = spec.resources.gpu.count > 0
    if vendor is not None and gpu:
        candidates = [r for r in candidates if vendor in r.spec.gpuVendors]
    elif gpu and any(r.spec.gpuVendors for r in candidates):
        candidates = [r for r in candidates if r.spec.gpuVendors]  # never a CPU-only image for a GPU
    if not candidates:
        where = f"{vendor} GPUs" if vendor and gpu else ("GPUs" if gpu else "this cluster")
        raise RenderError(
            "RuntimeNotFound",
            f"no InferenceRuntime serves backend {spec.backend!r} on {where}: "
            "apply one of your own and name it in spec.runtimeRef",
        )

    def rank(runtime: InferenceRuntime) -> tuple[bool, bool, bool, str]:
        # A runtime naming the vendor beats a generic one; without a GPU a CPU image comes first;
        # the shipped runtime is the default (a user's own runtime is chosen with runtimeRef);
        # then by name, to be deterministic.
        names_vendor = vendor is not None and vendor in runtime.spec.gpuVendors
        return (
            not names_vendor,
            not gpu and bool(runtime.spec.gpuVendors),
            runtime.metadata.labels.get(LABEL_SHIPPED) != "true",
            runtime.metadata.name,
        )

    return min(candidates, key=rank)


def _substitute(template: str, values: Mapping[str, str]) -> str:
    out = template
    for key, value in values.items():
        out = out.replace("{" + key + "}", value)
    return out


def _cached_weights(
    weights: Weights, settings: Settings
) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    """The node-cache entry of `weights.digest`, read-only: only that entry, not the whole cache."""
    assert weights.digest is not None
    entry = f"{settings.node_cache_dir.rstrip('/')}/entries/{dirname(weights.digest)}"
    volume = {"name": WEIGHTS_VOLUME, "hostPath": {"path": entry, "type": "Directory"}}
    files = f"{CACHE_MOUNT}/files"
    return (
        f"{files}/{weights.file}" if weights.file else files,
        [volume],
        [{"name": WEIGHTS_VOLUME, "mountPath": CACHE_MOUNT, "readOnly": True}],
    )


def _weights(
    model: Model, weights: Weights | None = None, settings: Settings | None = None
) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    """(model argument, volumes, volume mounts) from `spec.source`, or from the node cache."""
    if weights is not None and weights.digest is not None:
        return _cached_weights(weights, settings or Settings())
    source = model.spec.source
    if source is None:
        return model.served_name, [], []
    try:
        mounted = source_mount(source, model.spec.backend, WEIGHTS_VOLUME, WEIGHTS_ROOT)
    except SourceUnsupported as exc:
        raise RenderError("SourceUnsupported", str(exc)) from None
    return mounted.argument, list(mounted.volumes), list(mounted.mounts)


def owner_reference(body: Mapping[str, Any]) -> dict[str, Any]:
    """The Model `body` as the controlling owner of an object the operator writes."""
    meta = body["metadata"]
    return {
        "apiVersion": names.API_VERSION,
        "kind": "Model",
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(body: Mapping[str, Any], model: Model) -> dict[str, Any]:
    return {
        "name": names.backend_name(model.name),
        "namespace": body["metadata"]["namespace"],
        "labels": names.backend_labels(model.name),
        "ownerReferences": [owner_reference(body)],
    }


def _gpu_resources(model: Model, runtime: InferenceRuntime) -> dict[str, str]:
    gpu = model.spec.resources.gpu
    if gpu.count == 0:
        return {}
    vendor = gpu.vendor or (runtime.spec.gpuVendors[0] if runtime.spec.gpuVendors else None)
    resource = runtime.spec.acceleratorResources.get(vendor) if vendor else None
    if resource is None:
        raise RenderError(
            "NoAcceleratorResource",
            f"InferenceRuntime {runtime.metadata.name!r} names no accelerator resource for vendor {vendor!r}",
        )
    return {resource: str(gpu.count)}


def _covers(toleration: Mapping[str, Any], key: str) -> bool:
    """Whether `toleration` already tolerates a NoSchedule taint `key` of any value."""
    return (
        toleration.get("key") == key
        and toleration.get("operator") == "Exists"
        and toleration.get("effect") in (None, "NoSchedule")
    )


def _tolerations(model: Model, runtime: InferenceRuntime, gpu: Mapping[str, str]) -> list[dict[str, Any]]:
    """The runtime's, then the Model's, then one per accelerator resource the pod asks for.

    GPU nodes are commonly tainted with their device plugin's resource name (`nvidia.com/gpu`,
    `amd.com/gpu`); a pod requesting that resource tolerates the taint without being told.
    """
    items: list[dict[str, Any]] = []
    for toleration in (*runtime.spec.scheduling.tolerations, *model.spec.tolerations):
        dumped = toleration.model_dump(exclude_none=True)
        if dumped not in items:
            items.append(dumped)
    for resource in gpu:
        if not any(_covers(t, resource) for t in items):
            items.append({"key": resource, "operator": "Exists", "effect": "NoSchedule"})
    return items


def _probe(probe: RuntimeProbe, values: Mapping[str, str], failure_threshold: int | None = None) -> dict[str, Any]:
    return {
        "httpGet": {"path": _substitute(probe.path, values), "port": "http"},
        "initialDelaySeconds": probe.initialDelaySeconds,
        "periodSeconds": probe.periodSeconds,
        "timeoutSeconds": probe.timeoutSeconds,
        "failureThreshold": failure_threshold or probe.failureThreshold,
    }


def _probes(runtime: InferenceRuntime, values: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Startup (until loaded), then readiness and liveness side by side.

    Without a startup probe of its own the runtime's readiness probe is used, failing only after
    `progressDeadlineSeconds`: a slow load is never killed, and a liveness probe (which the kubelet
    holds back until the startup probe passes) only watches an engine that has loaded.
    """
    rt = runtime.spec
    if rt.startupProbe is not None:
        startup = _probe(rt.startupProbe, values)
    else:
        period = rt.readinessProbe.periodSeconds
        load = rt.lifecycle.progressDeadlineSeconds + rt.readinessProbe.initialDelaySeconds
        threshold = max(rt.readinessProbe.failureThreshold, math.ceil(load / period))
        startup = _probe(rt.readinessProbe, values, failure_threshold=threshold)
    probes = {"startupProbe": startup, "readinessProbe": _probe(rt.readinessProbe, values)}
    if rt.livenessProbe is not None:
        probes["livenessProbe"] = _probe(rt.livenessProbe, values)
    return probes


def _env(model: Model, runtime: InferenceRuntime, values: Mapping[str, str]) -> list[dict[str, Any]]:
    """Plain variables (the runtime's, then the Model's), then `secretEnv` as secretKeyRefs."""
    env = {k: _substitute(v, values) for k, v in runtime.spec.env.items()} | dict(model.spec.env)
    secret_names = {item.name for item in model.spec.secretEnv}
    out: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in sorted(env.items()) if k not in secret_names]
    out += [
        {"name": item.name, "valueFrom": {"secretKeyRef": item.secretKeyRef.model_dump()}}
        for item in model.spec.secretEnv
    ]
    return out


def _shm(runtime: InferenceRuntime) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A memory-backed /dev/shm of `shmSize` (a container runtime's default is 64 MiB)."""
    size = runtime.spec.shmSize
    if re.fullmatch(r"0+(\.0+)?([EPTGMK]i?)?", size):
        return [], []
    return (
        [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": size}}],
        [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}],  # noqa: S108 - the pod's own memory volume
    )


def _pull_secrets(model: Model, runtime: InferenceRuntime) -> list[dict[str, str]]:
    names_ = [ref.name for ref in (*runtime.spec.imagePullSecrets, *model.spec.imagePullSecrets)]
    return [{"name": name} for name in dict.fromkeys(names_)]


def _affinity(model: Model, cached: str | None = None) -> dict[str, Any] | None:
    """Required node affinity: the GPU architectures, and the node cache holding entry `cached`."""
    expressions: list[dict[str, Any]] = []
    arch = model.spec.resources.gpu.arch
    if arch and model.spec.resources.gpu.count > 0:
        expressions.append({"key": names.NODE_GPU_ARCH, "operator": "In", "values": list(arch)})
    if cached is not None:
        expressions.append({"key": names.cache_label(cached), "operator": "Exists"})
    if not expressions:
        return None
    term = {"matchExpressions": expressions}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}


def _adapters(
    model: Model, adapters: Sequence[LoRAAdapter]
) -> tuple[list[str], list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(arguments, environment, volumes, mounts) that give a base's pods its LoRAAdapters.

    llama.cpp loads adapters only at start: `--lora-init-without-apply` and `--lora FILE` for each,
    in id order, so a changed set rolls the pods. Engines that load at run time get their switch
    (`--enable-lora --max-loras N`), the adapters' volumes and a readiness gate the operator opens
    once it loaded them (`GATE_ADAPTERS`); it loads each adapter through their API, so a new
    adapter rolls nothing unless it needs a volume the pods lack.
    """
    backend = BACKENDS[model.spec.backend]
    if not adapters or not backend.serves_adapters:
        return [], [], [], []
    args: list[str] = []
    volumes: dict[str, dict[str, Any]] = {}
    mounts: dict[str, dict[str, Any]] = {}
    for adapter in adapters:
        mounted = adapter_mount(adapter, model.spec.backend)
        volumes.update((v["name"], v) for v in mounted.volumes)
        mounts.update((m["name"], m) for m in mounted.mounts)
        if backend.lora_arg:
            args += [backend.lora_arg, mounted.argument]
    if backend.lora_arg:
        args = [*backend.lora_start_args, *args]
        env: list[dict[str, Any]] = []
    else:
        values = {"max_adapters": str(model.spec.adapters.maxAdapters)}
        args = [_substitute(a, values) for a in backend.lora_runtime_args]
        env = [{"name": k, "value": v} for k, v in backend.lora_runtime_env]
    return args, env, list(volumes.values()), list(mounts.values())


def _args(model: Model, args: list[str], port: int) -> list[str]:
    """The container's arguments, with the KV-event flags its routing asks for (`kvEvents`: the
    engine publishes on the pod's port plus the offset; the gateways connect to the pod's IP)."""
    kv = model.spec.routing.kvEvents
    if kv is None:
        return args
    return [*args, *kv_events_argv(BACKENDS[model.spec.backend], args, port, kv.portOffset, kv.replayPortOffset)]


def pod_template(
    body: Mapping[str, Any],
    model: Model,
    runtime: InferenceRuntime,
    weights_state: Weights | None = None,
    settings: Settings | None = None,
    adapters: Sequence[LoRAAdapter] = (),
) -> dict[str, Any]:
    rt = runtime.spec
    cached = weights_state.digest if weights_state is not None else None
    weights, volumes, mounts = _weights(model, weights_state, settings)
    values = {"model": weights, "served_name": model.served_name, "port": str(rt.port), "host": "0.0.0.0"}
    shm_volumes, shm_mounts = _shm(runtime)
    lora_args, lora_env, lora_volumes, lora_mounts = _adapters(model, adapters)
    volumes, mounts = [*volumes, *lora_volumes, *shm_volumes], [*mounts, *lora_mounts, *shm_mounts]
    env = _env(model, runtime, values)
    env += [item for item in lora_env if all(e["name"] != item["name"] for e in env)]
    resources: dict[str, dict[str, str]] = {}
    gpu = _gpu_resources(model, runtime)
    requests = {k: v for k, v in (("cpu", model.spec.resources.cpu), ("memory", model.spec.resources.memory)) if v}
    if requests or gpu:
        resources["requests"] = {**requests, **gpu}
    if gpu:
        resources["limits"] = dict(gpu)
    container: dict[str, Any] = {
        "name": "backend",
        "image": rt.image,
        **({"command": [_substitute(c, values) for c in rt.command]} if rt.command else {}),
        "args": _args(model, [*(_substitute(a, values) for a in rt.args), *lora_args, *model.spec.args], rt.port),
        "ports": [{"name": "http", "containerPort": rt.port, "protocol": "TCP"}],
        "env": env,
        **_probes(runtime, values),
    }
    if resources:
        container["resources"] = resources
    if mounts:
        container["volumeMounts"] = mounts
    if rt.lifecycle.preStopDrainSeconds > 0:
        container["lifecycle"] = {"preStop": {"sleep": {"seconds": rt.lifecycle.preStopDrainSeconds}}}
    annotations = {names.ANNOTATION_BACKEND: model.spec.backend}
    if model.spec.resources.gpu.minVramMb:
        annotations[names.ANNOTATION_VRAM_ESTIMATE] = str(model.spec.resources.gpu.minVramMb)
    if cached is not None:
        annotations[names.ANNOTATION_WEIGHTS] = cached
    if rt.metrics.prefix:
        annotations[names.ANNOTATION_METRICS_PATH] = rt.metrics.path
        annotations[names.ANNOTATION_METRICS_PREFIX] = rt.metrics.prefix

    lora = BACKENDS[model.spec.backend]
    if adapters and lora.lora_arg:
        annotations[ANNOTATION_ADAPTERS] = ",".join(a.name for a in adapters)
    spec: dict[str, Any] = {
        "containers": [container],
        "terminationGracePeriodSeconds": max(
            rt.lifecycle.terminationGracePeriodSeconds, rt.lifecycle.preStopDrainSeconds + 1
        ),
    }
    node_selector = dict(rt.scheduling.nodeSelector) | dict(model.spec.nodeSelector)
    if node_selector:
        spec["nodeSelector"] = node_selector
    tolerations = _tolerations(model, runtime, gpu)
    if tolerations:
        spec["tolerations"] = tolerations
    affinity = _affinity(model, cached)
    if affinity:
        spec["affinity"] = affinity
    if volumes:
        spec["volumes"] = volumes
    pull_secrets = _pull_secrets(model, runtime)
    if pull_secrets:
        spec["imagePullSecrets"] = pull_secrets
    if rt.scheduling.priorityClassName:
        spec["priorityClassName"] = rt.scheduling.priorityClassName
    if rt.scheduling.schedulerName:
        spec["schedulerName"] = rt.scheduling.schedulerName
    if adapters and lora.lora_runtime_args and not lora.lora_arg:
        spec["readinessGates"] = [{"conditionType": GATE_ADAPTERS}]
    return {"metadata": {"labels": names.backend_labels(model.name), "annotations": annotations}, "spec": spec}


def deployment(
    body: Mapping[str, Any],
    model: Model,
    runtime: InferenceRuntime,
    initial_replicas: int | None,
    weights: Weights | None = None,
    settings: Settings | None = None,
    adapters: Sequence[LoRAAdapter] = (),
) -> dict[str, Any]:
    """The backend Deployment. `replicas` only when given: the scaler (KEDA or builtin) owns it."""
    spec: dict[str, Any] = {
        "selector": {"matchLabels": names.selector_labels(model.name)},
        "progressDeadlineSeconds": runtime.spec.lifecycle.progressDeadlineSeconds,
        "revisionHistoryLimit": 2,
        "template": pod_template(body, model, runtime, weights, settings, adapters),
    }
    if model.spec.resources.gpu.count > 0:
        # An accelerator cannot host old and new replica at once: replace, never surge.
        spec["strategy"] = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    if initial_replicas is not None:
        spec["replicas"] = initial_replicas
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(body, model), "spec": spec}


def service(body: Mapping[str, Any], model: Model, runtime: InferenceRuntime) -> dict[str, Any]:
    """Its EndpointSlices (labelled like the Service) are what the xDS feeder routes to."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(body, model),
        "spec": {
            "selector": names.selector_labels(model.name),
            "ports": [{"name": "http", "port": runtime.spec.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def pod_disruption_budget(body: Mapping[str, Any], model: Model) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(body, model),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": names.selector_labels(model.name)}},
    }


def scaled_object(body: Mapping[str, Any], model: Model, settings: Settings) -> dict[str, Any]:
    """KEDA's view of the Model: an `external-push` trigger on `wakegate scaler`.

    wakegate's own idle logic decides when a model idles: IsActive stays true for `idleTimeout`
    after the last demand, so `cooldownPeriod` is 0 (its default of 300 s, or `idleTimeout` again,
    would idle the model twice). KEDA ignores a pushed `false` and scales to zero at its next poll,
    so `pollingInterval` is a tenth of `idleTimeout` (1..30 s): the model idles within 10 % of
    `idleTimeout`, and a poll costs the scaler one in-memory IsActive and GetMetrics. The HPA KEDA
    creates for 1..N gets the builtin engine's windows (control/scaling/autoscale.py): scale out
    after `scale_out_window` in one step up to `max`, scale in after `scale_in_window`.
    """
    scaling = model.spec.scaling
    policy = policy_of(model)
    trigger: dict[str, Any] = {
        "type": "external-push",
        "metadata": {
            "scalerAddress": settings.scaler_address,
            "model": model.key,
            "targetInFlight": str(scaling.targetInFlight),
        },
    }
    if settings.keda_auth_secret is not None:
        trigger["authenticationRef"] = {"name": names.backend_name(model.name)}
    behavior = {
        "scaleUp": {
            "stabilizationWindowSeconds": math.ceil(policy.scale_out_window),
            "selectPolicy": "Max",
            "policies": [{"type": "Pods", "value": scaling.max, "periodSeconds": 1}],
        },
        "scaleDown": {
            "stabilizationWindowSeconds": math.ceil(policy.scale_in_window),
            "selectPolicy": "Max",
            "policies": [{"type": "Percent", "value": 100, "periodSeconds": 1}],
        },
    }
    return {
        "apiVersion": KEDA_API_VERSION,
        "kind": "ScaledObject",
        "metadata": _meta(body, model),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": names.backend_name(model.name)},
            "minReplicaCount": scaling.min,
            "maxReplicaCount": scaling.max,
            "pollingInterval": polling_interval(scaling.idleTimeout),
            "cooldownPeriod": 0,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": behavior}},
            "triggers": [trigger],
        },
    }


def polling_interval(idle_timeout: int) -> int:
    """KEDA's `pollingInterval` for a Model: when it notices IsActive turned false (1..30 s)."""
    return min(max(math.ceil(idle_timeout / 10), 1), 30)


def trigger_authentication(body: Mapping[str, Any], model: Model, secret: str) -> dict[str, Any]:
    """KEDA's client certificate for the scaler's mTLS, from `secret` in the Model's namespace."""
    return {
        "apiVersion": KEDA_API_VERSION,
        "kind": "TriggerAuthentication",
        "metadata": _meta(body, model),
        "spec": {
            "secretTargetRef": [
                {"parameter": parameter, "name": secret, "key": key} for parameter, key in KEDA_AUTH_KEYS
            ]
        },
    }


def render(
    body: Mapping[str, Any],
    runtime: InferenceRuntime,
    settings: Settings,
    initial_replicas: int | None = None,
    weights: Weights | None = None,
    adapters: Sequence[LoRAAdapter] = (),
    model: Model | None = None,
) -> Rendered:
    """Everything a Model owns. `body` is the Model object (metadata with namespace and uid);
    `model` is it parsed, when the caller has that already.

    `weights` is where the weights stand in the node caches (`operator.weights.weights_for`)
    for `cache: node|prewarm` Models: until they are Ready on some node only the Service (and
    the ModelCache the operator keeps for a `prewarm` Model) is rendered, so no pod exists to
    claim a GPU; then the pods mount the cache entry and go only to nodes that hold it.
    `adapters` are the LoRAAdapters the base serves, in id order (`k8s.adapters.select`).
    """
    model = model if model is not None else model_from_object(body)
    engine = model.spec.scaling.engine
    objects: list[dict[str, Any]] = [service(body, model, runtime)]
    conditions = list(weights.conditions) if weights is not None else []
    if weights is not None and weights.owned_cache is not None:
        objects.append(weights.owned_cache)
    if weights is not None and weights.digest is None:
        autoscaling = Condition("AutoscalingReady", "False", "WaitingForWeights", weights.message)
        return Rendered(objects, autoscaling, runtime.metadata.name, conditions)
    if engine is ScalingEngine.KEDA and not settings.keda_available:
        autoscaling = Condition(
            "AutoscalingReady",
            "False",
            "ScaledObjectCRDMissing",
            "scaling.engine is keda but the ScaledObject CRD (keda.sh) is not installed; "
            "install KEDA or set spec.scaling.engine: builtin",
        )
        return Rendered(objects, autoscaling, runtime.metadata.name, conditions)
    objects.append(deployment(body, model, runtime, initial_replicas, weights, settings, adapters))
    if model.spec.scaling.max > 1:
        objects.append(pod_disruption_budget(body, model))
    if engine is ScalingEngine.KEDA:
        if settings.keda_auth_secret is not None:
            objects.append(trigger_authentication(body, model, settings.keda_auth_secret))
        objects.append(scaled_object(body, model, settings))
        autoscaling = Condition("AutoscalingReady", "True", "ScaledObjectApplied", "KEDA external-push")
    else:
        autoscaling = Condition("AutoscalingReady", "True", "BuiltinScaler", "replicas owned by wakegate scaler")
    return Rendered(objects, autoscaling, runtime.metadata.name, conditions)
