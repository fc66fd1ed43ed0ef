"""The operator's I/O: Kopf watches feed a coalescing work queue; each reconcile renders and applies.

Kopf watches Models, InferenceRuntimes, ModelCaches, the backend Deployments and Pods (by
label) and the ScaledObject CRD. Handlers only record and enqueue the Model's
key; a few workers reconcile one key at a time: render (pure), server-side apply
when the rendering changed, delete owned kinds no longer rendered, compute the
status (pure) and patch it only when it differs. A ModelCache event re-reconciles the
Models of its namespace that read the node caches, and the ModelCache's own summary status
(ready/wanted nodes; the per-node entries are the agents'). A LoRAAdapter event re-reconciles its
base (llama.cpp pods start with the base's adapters; vLLM-style pods get them loaded over HTTP by
`lora_loading`) and its own status (`lora_status`), which every reconcile of the base pokes too.
Kopf's on-event handlers keep
no state on the objects (no annotations, no finalizers), so an unchanged world
causes no writes at all.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import kopf
from pydantic import ValidationError

from wakegate.control.backends import BACKENDS
from wakegate.control.delivery import catalog as cat
from wakegate.control.delivery.credentials import Credentials, DockerAuths, parse_docker_config
from wakegate.control.delivery.errors import DeliveryError
from wakegate.control.delivery.listing import list_registry
from wakegate.control.delivery.registry import RegistryClient, RegistrySettings
from wakegate.control.k8s import names
from wakegate.control.k8s.adapters import GATE_ADAPTERS, Selection, adapter_mount, select
from wakegate.control.k8s.client import Kube, KubeError, path
from wakegate.control.k8s.objects import model_from_object, modelcache_from_object, modelcatalog_from_object
from wakegate.control.operator import pinning
from wakegate.control.operator import render as rnd
from wakegate.control.operator.lora_loading import RuntimeLoader, Wanted
from wakegate.control.operator.lora_status import (
    AdapterObserved,
    adapter_status,
    gate_open,
    ready_pods,
    started_with,
)
from wakegate.control.operator.metrics import OperatorMetrics
from wakegate.control.operator.status import Observed, compute, failed_pods, routing_path_status, swap_holder
from wakegate.control.operator.weights import cache_summary, weights_for
from wakegate.control.schema import InferenceRuntime, LoRAAdapter, Model

log = logging.getLogger("wakegate.operator")

SCALEDOBJECT_CRD = "scaledobjects.keda.sh"
BACKEND_LABELS = {names.LABEL_COMPONENT: "model-backend", names.LABEL_MANAGED_BY: names.MANAGED_BY}
#: Queue keys of ModelCaches (their summary status) carry this prefix; Model keys carry none.
CACHE_KEY = "ModelCache:"
#: Queue keys of ModelCatalogs (a listing of their registry) carry this prefix.
CATALOG_KEY = "ModelCatalog:"
#: Queue keys of LoRAAdapters (their status) carry this prefix.
ADAPTER_KEY = "LoRAAdapter:"
#: Seconds before a base whose engine refused an adapter load is tried again.
ADAPTER_RETRY = 10.0
#: Docker config key of a `kubernetes.io/dockerconfigjson` Secret.
DOCKER_CONFIG_KEY = ".dockerconfigjson"
#: The longest the catalog timer sleeps between looks (a new catalog wakes it at once).
CATALOG_TICK = 30.0
#: Seconds before a Model whose oci:// tag could not be resolved is tried again.
PIN_RETRY = 30.0


def _rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _replicas_owned_elsewhere(deployment: Mapping[str, Any]) -> bool:
    """Whether a manager other than the operator's apply owns spec.replicas (the scaler, KEDA's HPA)."""
    for entry in deployment.get("metadata", {}).get("managedFields") or []:
        if entry.get("manager") == names.FIELD_MANAGER and entry.get("operation") == "Apply":
            continue
        if "f:replicas" in ((entry.get("fieldsV1") or {}).get("f:spec") or {}):
            return True
    return False


class Reconciler:
    def __init__(self, kube: Kube, settings: rnd.Settings, workers: int = 4) -> None:
        self.kube = kube
        self.settings = settings
        self.models: dict[str, dict[str, Any]] = {}
        self.runtimes: dict[str, dict[str, Any]] = {}
        #: the runtimes parsed once per watch event (None: invalid), not once per reconcile
        self._parsed_runtimes: dict[str, InferenceRuntime | None] = {}
        self.deployments: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, dict[str, Any]]] = {}
        #: ModelCaches by namespace, then name
        self.caches: dict[str, dict[str, dict[str, Any]]] = {}
        #: ModelCatalogs by "namespace/name"
        self.catalogs: dict[str, dict[str, Any]] = {}
        #: LoRAAdapters by namespace, then name
        self.adapters: dict[str, dict[str, dict[str, Any]]] = {}
        #: adapters loaded at run time (vLLM-style bases), per pod
        self.lora_loader = RuntimeLoader()
        #: adapter key -> pods already counted as having loaded it
        self._adapter_seen: dict[str, set[str]] = {}
        #: adapter key -> [loads, refused loads]; taken from its status once, then counted here
        #: (a watch event may bring an older copy of the status than the one we wrote)
        self._adapter_counts: dict[str, list[int]] = {}
        self._listing: set[str] = set()
        self._catalog_wake = asyncio.Event()
        #: how registries are reached (CA file from the operator's flags); credentials per catalog
        self.registry_settings = RegistrySettings()
        self.applied: dict[str, str] = {}
        #: Model key -> (uid, spec.source, the pinned source its pods use): the newest pin, kept here
        #: as well as in status (a watch event may bring an older status than the one we wrote)
        self._pins: dict[str, tuple[str | None, str, str]] = {}
        #: Model key -> (uid, spec.source, monotonic time before which the registry is not asked
        #: again, the error): a tag that did not resolve
        self._pin_failures: dict[str, tuple[str | None, str, float, rnd.RenderError]] = {}
        self._was_running: dict[str, bool] = {}
        self._started_at: dict[str, float] = {}
        self._stopped_at: dict[str, float] = {}
        #: Failed pods whose deletion was refused (said once, not tried again).
        self._unprunable: set[str] = set()
        self.workers = workers
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._queued: set[str] = set()
        #: keys a worker is reconciling now, and those of them poked meanwhile (queued again after)
        self._busy: set[str] = set()
        self._again: set[str] = set()
        self.export_to(OperatorMetrics())

    def export_to(self, metrics: OperatorMetrics) -> None:
        """Feed these metrics (the process's /metrics) from what this reconciler sees."""
        self.metrics = metrics
        metrics.watch(lambda: {key: self.deployments.get(key) for key in self.models})

    # -- queue ----------------------------------------------------------------------------------

    def poke(self, key: str) -> None:
        if key in self._busy:
            self._again.add(key)  # one worker per key: reconciled again once this one is done
        elif key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    async def run(self) -> None:
        await asyncio.gather(self._catalog_timer(), *(self._worker() for _ in range(self.workers)))

    async def _catalog_timer(self) -> None:
        """Queue every ModelCatalog whose refresh is due, then sleep until the next one is."""
        while True:
            self._catalog_wake.clear()
            delays = [CATALOG_TICK]
            for key, body in list(self.catalogs.items()):
                if key in self._listing:
                    continue
                delay = catalog_delay(body, time.time())
                if delay <= 0:
                    self._listing.add(key)
                    self.poke(CATALOG_KEY + key)
                else:
                    delays.append(delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._catalog_wake.wait(), timeout=min(delays))

    async def _worker(self) -> None:
        while True:
            key = await self._queue.get()
            self._queued.discard(key)
            self._busy.add(key)
            try:
                await self.reconcile(key)
            except (KubeError, OSError) as exc:
                log.warning("reconcile %s failed: %s; retrying", key, exc)
                asyncio.get_running_loop().call_later(2.0, self.poke, key)
            except Exception:
                log.exception("reconcile %s crashed; retrying", key)
                asyncio.get_running_loop().call_later(5.0, self.poke, key)
            finally:
                self._busy.discard(key)
                if key in self._again:
                    self._again.discard(key)
                    self.poke(key)

    # -- watch events -----------------------------------------------------------------------------

    def on_model(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        meta = body["metadata"]
        key = names.model_key(meta["namespace"], meta["name"])
        if event_type == "DELETED":
            self.models.pop(key, None)
        else:
            self.models[key] = _plain(body)
        self.poke(key)

    def on_runtime(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        name = body["metadata"]["name"]
        if event_type == "DELETED":
            self.runtimes.pop(name, None)
            self._parsed_runtimes.pop(name, None)
        else:
            self.runtimes[name] = _plain(body)
            self._parsed_runtimes[name] = rnd.parse_runtime(body)
        backend = (body.get("spec") or {}).get("backend")
        for key, model in self.models.items():
            spec = model.get("spec") or {}
            if spec.get("backend") == backend or (spec.get("runtimeRef") or {}).get("name") == name:
                self.poke(key)

    def on_cache(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        meta = body["metadata"]
        namespace = meta["namespace"]
        _record(self.caches.setdefault(namespace, {}), meta["name"], event_type, body)
        if event_type != "DELETED":
            self.poke(CACHE_KEY + names.model_key(namespace, meta["name"]))
        for key, model in self.models.items():
            cache = ((model.get("spec") or {}).get("cache") or {}).get("strategy", "none")
            if model["metadata"]["namespace"] == namespace and cache != "none":
                self.poke(key)

    def on_catalog(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        meta = body["metadata"]
        _record(self.catalogs, names.model_key(meta["namespace"], meta["name"]), event_type, body)
        self._catalog_wake.set()

    def on_adapter(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """Record a LoRAAdapter; its status is due, and its base's pods too when its spec changed
        (a status write of our own changes no generation and rolls nothing)."""
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        store = self.adapters.setdefault(namespace, {})
        old = store.get(name)
        _record(store, name, event_type, body)
        self.poke(ADAPTER_KEY + names.model_key(namespace, name))
        if old is not None and event_type != "DELETED" and old["metadata"].get("generation") == meta.get("generation"):
            return
        for was in (old, None if event_type == "DELETED" else body):
            base = ((was or {}).get("spec") or {}).get("baseModel")
            if isinstance(base, str):
                self.poke(names.model_key(namespace, base))

    def on_deployment(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        key = names.owning_model_key(body["metadata"])
        if key is not None:
            _record(self.deployments, key, event_type, body)
            self._poke_with_group(key)

    def on_pod(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        key = names.owning_model_key(body["metadata"])
        if key is not None:
            _record(self.pods.setdefault(key, {}), body["metadata"]["name"], event_type, body)
            self.metrics.observe_pod(key, body, deleted=event_type == "DELETED")
            self.poke(key)

    def on_keda_crd(self, present: bool) -> None:
        if present == self.settings.keda_available:
            return
        log.info("ScaledObject CRD %s", "installed" if present else "removed")
        self.settings = replace(self.settings, keda_available=present)
        for key, model in self.models.items():
            if ((model.get("spec") or {}).get("scaling") or {}).get("engine", "keda") == "keda":
                self.applied.pop(key, None)
                self.poke(key)

    def _poke_with_group(self, key: str) -> None:
        self.poke(key)
        group = self._group_of(self.models.get(key))
        if group is not None:
            for other, model in self.models.items():
                if self._group_of(model) == group:
                    self.poke(other)

    # -- reconcile ------------------------------------------------------------------------------

    async def reconcile(self, key: str) -> None:
        if key.startswith(CACHE_KEY):
            await self._reconcile_cache(key.removeprefix(CACHE_KEY))
            return
        if key.startswith(ADAPTER_KEY):
            await self._reconcile_adapter(key.removeprefix(ADAPTER_KEY))
            return
        if key.startswith(CATALOG_KEY):
            try:
                await self._refresh_catalog(key.removeprefix(CATALOG_KEY))
            finally:
                self._listing.discard(key.removeprefix(CATALOG_KEY))
                self._catalog_wake.set()
            return
        body = self.models.get(key)
        if body is None or body["metadata"].get("deletionTimestamp"):
            # Owner references cascade the deletion; only our memory needs forgetting.
            for memory in (self.applied, self.pods, self._pins, self._pin_failures, self._was_running,
                           self._started_at, self._stopped_at):
                memory.pop(key, None)
            self.lora_loader.forget(key)
            self._poke_adapters_of(key)
            return
        generation = int(body["metadata"].get("generation", 0))
        autoscaling = rnd.Condition("AutoscalingReady", "Unknown", "NotRendered")
        render_error: rnd.Condition | None = None
        weights = None
        model: Model | None = None
        adapters: tuple[LoRAAdapter, ...] = ()
        pinned: str | None = None
        try:
            model = model_from_object(body)
            pinned = await self._pin(key, body, model)
            served_body = pinning.pinned_body(body, pinned) if pinned else body
            caches = self.caches.get(body["metadata"]["namespace"], {}).values()
            served_model = model if served_body is body else model_from_object(served_body)
            weights = weights_for(served_body, served_model, caches)
            runtime = rnd.select_runtime(model, self._runtimes())
            adapters = self.selection(body["metadata"]["namespace"]).of(model.name)
            autoscaling = (await self._apply(key, served_body, runtime, weights, adapters, served_model)).autoscaling
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            render_error = rnd.Condition("Ready", "False", "InvalidSpec", problems)
        except rnd.RenderError as exc:
            render_error = rnd.Condition("Ready", "False", exc.reason, str(exc))
        await self._prune_failed_pods(key, body["metadata"]["namespace"])
        observed = Observed(
            generation=generation,
            deployment=self.deployments.get(key),
            pods=list(self.pods.get(key, {}).values()),
            autoscaling=autoscaling,
            render_error=render_error,
            preempted_by=self._preempted_by(key),
            waiting_for=(body.get("status") or {}).get(names.STATUS_WAITING_FOR),
            weights=weights,
        )
        previous = body.get("status") or {}
        status = compute(observed, previous, _rfc3339())
        status[pinning.STATUS_FIELD] = pinned or self._kept_pin(key, body)
        if model is not None:
            served = model.with_adapters(adapters) if adapters else model
            status.update(
                routing_path_status(served, observed.pods, status["admitted"], self.settings.native_path)
            )
        if any(previous.get(k) != v for k, v in status.items()):
            await self._patch_status("Model", body, status, status, lambda: self.models.get(key))
            if status["readyReplicas"] > 0 and not int(previous.get("readyReplicas", 0) or 0):
                self.metrics.observe_cold_start(key, observed.pods)
        if model is not None and BACKENDS[model.spec.backend].lora_runtime_args:
            await self._load_adapters(key, model, adapters)
        self._poke_adapters_of(key)

    # -- oci:// tags pinned to digests ------------------------------------------------------------

    async def _pin(self, key: str, body: Mapping[str, Any], model: Model) -> str | None:
        """The Model's source pinned to a digest (`pinning`) when it names an oci:// tag: the pin
        already made for this `spec.source`, else the digest the registry gives for the tag now
        (with the Model's and runtime's imagePullSecrets). A registry that cannot answer is a
        render error with its reason, and the registry is asked again only `PIN_RETRY` seconds
        later (however many events come meanwhile); nothing is rendered from the tag until then."""
        source = model.spec.source
        tag = pinning.tag_source(source)
        if source is None or tag is None:
            return None
        uid = body["metadata"].get("uid")
        kept = self._pins.get(key)
        if kept is not None and kept[:2] == (uid, source):
            return kept[2]
        failed = self._pin_failures.get(key)
        if failed is not None and failed[:2] == (uid, source) and time.monotonic() < failed[2]:
            raise failed[3]
        pinned = pinning.recorded(source, body.get("status"))
        if pinned is None:
            refs = list(model.spec.imagePullSecrets)
            with contextlib.suppress(rnd.RenderError):  # the runtime's too, when there is one
                refs += rnd.select_runtime(model, self._runtimes()).spec.imagePullSecrets
            auths = await self._registry_auths_of(body["metadata"]["namespace"], [ref.name for ref in refs])
            try:
                async with RegistryClient(tag.registry, self.registry_settings, auths) as client:
                    digest, _, _ = await client.manifest(tag.repository, tag.reference)
            except DeliveryError as exc:
                error = rnd.RenderError(exc.reason, f"cannot resolve {source} to a digest: {exc}")
                self._pin_failures[key] = (uid, source, time.monotonic() + PIN_RETRY, error)
                asyncio.get_running_loop().call_later(PIN_RETRY, self.poke, key)
                raise error from None
            pinned = str(tag.at(digest))
            log.info("Model %s: %s pinned to %s", key, source, digest)
        self._pin_failures.pop(key, None)
        self._pins[key] = (uid, source, pinned)
        return pinned

    def _kept_pin(self, key: str, body: Mapping[str, Any]) -> str | None:
        """The pin status keeps while the Model cannot be rendered: the one of its current source."""
        source = (body.get("spec") or {}).get("source")
        kept = self._pins.get(key)
        if kept is not None and kept[:2] == (body["metadata"].get("uid"), source):
            return kept[2]
        return pinning.recorded(source, body.get("status")) if isinstance(source, str) else None

    async def _registry_auths_of(self, namespace: str, secrets: list[str]) -> DockerAuths:
        """Registry credentials from the named dockerconfigjson Secrets, the first naming a host
        winning (as the kubelet tries them); one that cannot be read is skipped with a warning that
        names it (the pull is then anonymous for its registries, as the kubelet's would be)."""
        by_host: dict[str, Credentials] = {}
        for name in dict.fromkeys(secrets):
            try:
                auths = await self._registry_auths(namespace, name)
            except ValueError as exc:
                log.warning("imagePullSecret skipped: %s", exc)
                continue
            for host, credentials in auths.by_host.items():
                by_host.setdefault(host, credentials)
        return DockerAuths(by_host)

    # -- LoRA adapters ----------------------------------------------------------------------------

    def selection(self, namespace: str) -> Selection:
        """The namespace's LoRAAdapters per base (`k8s.adapters.select`), as the feeder sees them."""
        bodies = self.adapters.get(namespace, {})
        if not bodies:
            return Selection()
        bases: dict[str, Model | None] = {}
        for adapter in bodies.values():
            base = (adapter.get("spec") or {}).get("baseModel")
            found = self.models.get(names.model_key(namespace, str(base)))
            if isinstance(base, str) and found is not None and base not in bases:
                try:
                    bases[base] = model_from_object(found)
                except ValidationError:
                    bases[base] = None
        return select(bases, bodies.values())

    def _poke_adapters_of(self, model_key: str) -> None:
        namespace, _, name = model_key.partition("/")
        for adapter_name, adapter in self.adapters.get(namespace, {}).items():
            if (adapter.get("spec") or {}).get("baseModel") == name:
                self.poke(ADAPTER_KEY + names.model_key(namespace, adapter_name))

    async def _load_adapters(self, key: str, model: Model, adapters: tuple[LoRAAdapter, ...]) -> None:
        """Load a run-time-loading base's adapters into the pods whose engine answers (and unload
        removed ones), then open those pods' readiness gate: a pod is routed only once its
        adapters are in (a refused load is retried, the base serves on without it)."""
        namespace = key.partition("/")[0]
        pods = list(self.pods.get(key, {}).values())
        wanted = [Wanted(a.name, a.served_name, adapter_mount(a, model.spec.backend).argument) for a in adapters]
        engines = ready_pods(pods, "ContainersReady")
        await self.lora_loader.sync(key, pods, wanted, engines)
        if any(f"{namespace}/{a.name}" in self.lora_loader.failures for a in adapters):
            asyncio.get_running_loop().call_later(ADAPTER_RETRY, self.poke, key)
        synced = self.lora_loader.synced(key)
        for pod in pods:
            gates = (pod.get("spec") or {}).get("readinessGates") or []
            gated = any(g.get("conditionType") == GATE_ADAPTERS for g in gates)
            up = pod["metadata"]["name"] in synced
            if gated and up != gate_open(pod, GATE_ADAPTERS):
                await self._set_gate(pod, up)

    async def _set_gate(self, pod: Mapping[str, Any], loaded: bool) -> None:
        """The pod condition of the adapters' readiness gate (server-side apply: only that entry)."""
        meta = pod["metadata"]
        condition = {"type": GATE_ADAPTERS, "status": "True" if loaded else "False", "lastTransitionTime": _rfc3339(),
                     "reason": "AdaptersLoaded" if loaded else "EngineNotReady"}
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
                "status": {"conditions": [condition]}}
        try:
            await asyncio.to_thread(self.kube.apply_status, body, names.FIELD_MANAGER)
        except KubeError as exc:
            if exc.status != 404:
                raise

    async def _reconcile_adapter(self, key: str) -> None:
        """A LoRAAdapter's status: its base's pods that hold it, or why none does."""
        namespace, _, name = key.partition("/")
        body = self.adapters.get(namespace, {}).get(name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self._adapter_seen.pop(key, None)
            self._adapter_counts.pop(key, None)
            self.lora_loader.failures.pop(key, None)
            self.lora_loader.new_failures.pop(key, None)
            return
        base = str((body.get("spec") or {}).get("baseModel") or "")
        refused = self.selection(namespace).refused.get(name)
        pods = list(self.pods.get(names.model_key(namespace, base), {}).values())
        holders: dict[str, str] = {}
        at_start = False
        if refused is None:
            backend = BACKENDS[model_from_object(self.models[names.model_key(namespace, base)]).spec.backend]
            at_start = bool(backend.lora_arg)
            holders = started_with(pods, name) if at_start else self.lora_loader.holders(key)
        previous = body.get("status") or {}
        seen = self._adapter_seen.setdefault(key, set(previous.get("replicas") or []))
        counts = self._adapter_counts.setdefault(
            key, [int(previous.get("loads", 0) or 0), int(previous.get("failures", 0) or 0)]
        )
        counts[0] += len(set(holders) - seen)
        counts[1] += self.lora_loader.take_failures(key)
        seen.update(holders)
        observed = AdapterObserved(
            generation=int(body["metadata"].get("generation", 0)),
            base=base,
            refused=refused,
            holders=holders,
            ready_replicas=len(ready_pods(pods)),
            loads=counts[0],
            failures=counts[1],
            failure=self.lora_loader.failures.get(key),
            at_start=at_start,
        )
        status = adapter_status(observed, previous, _rfc3339())
        if any(previous.get(k) != v for k, v in status.items()):
            await self._patch_status("LoRAAdapter", body, status, status,
                                     lambda: self.adapters.get(namespace, {}).get(name))

    async def _patch_status(self, kind: str, body: Mapping[str, Any], patch: Mapping[str, Any],
                            whole: Mapping[str, Any], current: Callable[[], dict[str, Any] | None]) -> None:
        """Patch an object's status, and keep what the server answered in our copy of it (unless
        it was deleted, or replaced by another object of the same name, meanwhile)."""
        meta = body["metadata"]
        try:
            updated = await asyncio.to_thread(
                self.kube.patch_status, path(names.API_VERSION, kind, meta["namespace"], meta["name"]), patch
            )
        except KubeError as exc:
            if exc.status == 404:
                return
            raise
        copy = current()
        if copy is not None and copy["metadata"].get("uid") == meta.get("uid"):
            copy["status"] = updated.get("status", dict(whole))

    async def _prune_failed_pods(self, key: str, namespace: str) -> None:
        """Delete the Model's pods that ended Failed (evicted, node shut down), one log line each.

        A refusal (an install whose role lacks `delete` on pods) is said once per pod and does not
        stop the reconcile: the pod only lingers, as it would without the operator.
        """
        pods = self.pods.get(key, {})
        for name, why in failed_pods(list(pods.values())):
            if name in self._unprunable:
                continue
            target = path("v1", "Pod", namespace, name)
            try:
                deleted = await asyncio.to_thread(self.kube.delete, target)
            except KubeError as exc:
                if exc.status != 403:
                    raise
                self._unprunable.add(name)
                log.warning("cannot delete failed backend pod %s/%s: %s", namespace, name, exc)
                continue
            if deleted:
                log.info("deleted failed backend pod %s/%s of Model %s (%s)", namespace, name, key, why)
            pods.pop(name, None)

    async def _reconcile_cache(self, key: str) -> None:
        """A ModelCache's summary status from its per-node entries, patched only when it differs."""
        namespace, _, name = key.partition("/")
        body = self.caches.get(namespace, {}).get(name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        previous = body.get("status") or {}
        invalid = None
        try:
            modelcache_from_object(body)
        except ValidationError as exc:
            invalid = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        summary = cache_summary(body, previous, _rfc3339(), invalid)
        if all(previous.get(k) == v for k, v in summary.items()):
            return
        await self._patch_status("ModelCache", body, summary, {**previous, **summary},
                                 lambda: self.caches.get(namespace, {}).get(name))

    async def _refresh_catalog(self, key: str) -> None:
        """List a ModelCatalog's registry and write what it found (or why it could not) to status."""
        body = self.catalogs.get(key)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        meta = body["metadata"]
        namespace = meta["namespace"]
        token = (meta.get("annotations") or {}).get(cat.REFRESH_ANNOTATION)
        try:
            catalog = modelcatalog_from_object(body)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            result = cat.Refreshed((), (), ("InvalidSpec", problems))
        else:
            spec = catalog.spec
            try:
                auths = await self._registry_auths(namespace, spec.credentials.name if spec.credentials else None)
            except ValueError as exc:
                result = cat.Refreshed((), (), ("bad_credentials", str(exc)))
            else:
                settings = replace(self.registry_settings, plain_http=spec.plainHTTP)
                result = await list_registry(spec.registry, spec.repositories, settings, auths)
        previous = body.get("status") or {}
        status = cat.catalog_status(result, previous, _rfc3339(), int(meta.get("generation", 0)), token)
        if result.failure is not None:
            log.warning("catalog %s: %s (%s)", key, result.failure[1], result.failure[0])
        await self._patch_status("ModelCatalog", body, status, status, lambda: self.catalogs.get(key))

    async def _registry_auths(self, namespace: str, secret: str | None) -> DockerAuths:
        """The credentials of a registry-credential Secret (a catalog's, a Model's imagePullSecret),
        kept in memory only (never on disk or in a log)."""
        if secret is None:
            return DockerAuths()
        try:
            body = await asyncio.to_thread(self.kube.get, path("v1", "Secret", namespace, secret))
        except KubeError as exc:
            why = "does not exist" if exc.status == 404 else f"cannot be read ({exc.status})"
            raise ValueError(f"credentials Secret {namespace}/{secret} {why}") from None
        return secret_auths(body, f"credentials Secret {namespace}/{secret}")

    def _runtimes(self) -> list[InferenceRuntime]:
        return [r for r in self._parsed_runtimes.values() if r is not None]

    def _prunable(self, namespace: str, api_version: str, kind: str, name: str, owner: str | None) -> bool:
        """A ModelCache is deleted only when this Model owns it (a person's may carry the same name)."""
        if kind != "ModelCache":
            return True
        cache = self.caches.get(namespace, {}).get(name)
        refs = (cache or {}).get("metadata", {}).get("ownerReferences") or []
        return cache is not None and any(ref.get("uid") == owner for ref in refs)

    async def _apply(
        self, key: str, body: dict[str, Any], runtime: InferenceRuntime, weights: Any = None,
        adapters: tuple[LoRAAdapter, ...] = (), model: Model | None = None,
    ) -> rnd.Rendered:
        """Apply what the Model renders to, when that changed; seed replicas once for a new Deployment."""
        deployment = self.deployments.get(key)
        first = False
        if deployment is None and key not in self.applied:
            meta = body["metadata"]
            deployment = await asyncio.to_thread(
                self.kube.get_or_none,
                path("apps/v1", "Deployment", meta["namespace"], names.backend_name(meta["name"])),
            )
            first = deployment is None and rnd.never_reconciled(body)
        model = model if model is not None else model_from_object(body)
        rendered = rnd.render(body, runtime, self.settings, weights=weights, adapters=adapters, model=model)
        if self.applied.get(key) == rendered.digest():
            return rendered
        seed: int | None = None
        if deployment is None or not _replicas_owned_elsewhere(deployment):
            current = ((deployment or {}).get("spec") or {}).get("replicas")
            seed = int(current) if current is not None else model.spec.scaling.min
            rendered_with_seed = rnd.render(
                body, runtime, self.settings, initial_replicas=seed, weights=weights, adapters=adapters, model=model
            )
        else:
            rendered_with_seed = rendered
        kinds = {(obj["apiVersion"], obj["kind"]) for obj in rendered.objects}
        for obj in rendered_with_seed.objects:
            result = await asyncio.to_thread(self.kube.apply, obj)
            if obj["kind"] == "Deployment" and seed is not None:
                # Hand spec.replicas to the scaler's field manager, then drop it from ours: the
                # scaler (builtin or KEDA) owns replicas from here on, and our applies never
                # reset it.
                handoff = {
                    "apiVersion": "apps/v1",
                    "kind": "Deployment",
                    "metadata": {"name": obj["metadata"]["name"], "namespace": obj["metadata"]["namespace"]},
                    "spec": {"replicas": seed},
                }
                await asyncio.to_thread(self.kube.apply, handoff, names.SCALER_FIELD_MANAGER)
                without = next(o for o in rendered.objects if o["kind"] == "Deployment")
                result = await asyncio.to_thread(self.kube.apply, without)
            if obj["kind"] == "Deployment":
                self.deployments[key] = result
        meta = body["metadata"]
        for api_version, kind in () if first else rnd.PRUNABLE_KINDS:  # a new Model has nothing to prune
            if (api_version, kind) in kinds or (kind in rnd.KEDA_KINDS and not self.settings.keda_available):
                continue
            name = names.backend_name(meta["name"])
            if not self._prunable(meta["namespace"], api_version, kind, name, meta.get("uid")):
                continue
            target = path(api_version, kind, meta["namespace"], name)
            if await asyncio.to_thread(self.kube.delete, target):
                log.info("deleted %s %s (no longer rendered)", kind, target)
        self.applied[key] = rendered.digest()
        return rendered

    # -- GPU groups -----------------------------------------------------------------------------

    @staticmethod
    def _group_of(body: Mapping[str, Any] | None) -> str | None:
        if body is None:
            return None
        shared = ((body.get("spec") or {}).get("gpu") or {}).get("shared")
        return f"{body['metadata']['namespace']}/{shared}" if shared else None

    def _running(self, key: str) -> bool:
        deployment = self.deployments.get(key) or {}
        return int((deployment.get("spec") or {}).get("replicas", 0) or 0) > 0

    def _preempted_by(self, key: str) -> str | None:
        """The group peer that swapped this Model out, while it holds the accelerator."""
        group = self._group_of(self.models.get(key))
        if group is None:
            return None
        now = time.monotonic()
        running: dict[str, bool] = {}
        for member, body in self.models.items():
            if self._group_of(body) != group:
                continue
            up = self._running(member)
            previous = self._was_running.get(member)
            if previous is not None and previous != up:
                (self._started_at if up else self._stopped_at)[member] = now
            self._was_running[member] = up
            running[member] = up
        return swap_holder(key, running, self._started_at, self._stopped_at)


def catalog_delay(body: Mapping[str, Any], now: float) -> float:
    """Seconds until a ModelCatalog is listed again, from what its status says was done last."""
    status = body.get("status") or {}
    meta = body.get("metadata") or {}
    refresh = int((body.get("spec") or {}).get("refreshSeconds") or 300)
    observed = status.get("observedGeneration")
    return cat.refresh_delay(
        refresh, cat.parse_time(status.get("lastRefreshTime")), int(meta.get("generation", 0)),
        int(observed) if observed is not None else None,
        (meta.get("annotations") or {}).get(cat.REFRESH_ANNOTATION), status.get("refreshToken"), now,
    )


def secret_auths(body: Mapping[str, Any], where: str) -> DockerAuths:
    """The Docker config of a `kubernetes.io/dockerconfigjson` Secret; a ValueError naming `where`
    (never the content) when it holds none."""
    encoded = (body.get("data") or {}).get(DOCKER_CONFIG_KEY)
    if not encoded:
        raise ValueError(f"{where} has no {DOCKER_CONFIG_KEY} key")
    try:
        text = base64.b64decode(encoded, validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise ValueError(f"{where}: {DOCKER_CONFIG_KEY} is not base64 text") from None
    auths = parse_docker_config(text, where)
    for line in auths.unsupported:
        log.warning("registry credentials: %s", line)
    return auths


def _record(store: dict[str, dict[str, Any]], key: str, event_type: str | None, body: Mapping[str, Any]) -> None:
    """Keep the newest copy of an object, or forget it when it was deleted."""
    if event_type == "DELETED":
        store.pop(key, None)
    else:
        store[key] = _plain(body)


def _plain(body: Mapping[str, Any]) -> dict[str, Any]:
    """A detached copy of a Kopf body (Kopf reuses and mutates its views)."""
    return {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in body.items()}


def register(registry: kopf.OperatorRegistry, reconciler: Reconciler) -> None:
    """Kopf handlers: record the object, enqueue the Model it belongs to. Nothing is written here."""

    async def model_event(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        reconciler.on_model(event.get("type"), body)

    async def runtime_event(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        reconciler.on_runtime(event.get("type"), body)

    async def deployment_event(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        reconciler.on_deployment(event.get("type"), body)

    async def pod_event(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        reconciler.on_pod(event.get("type"), body)

    async def cache_event(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        reconciler.on_cache(event.get("type"), body)

    async def catalog_event(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        reconciler.on_catalog(event.get("type"), body)

    async def adapter_event(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        reconciler.on_adapter(event.get("type"), body)

    async def crd_event(event: Mapping[str, Any], **_: Any) -> None:
        reconciler.on_keda_crd(event.get("type") != "DELETED")

    on_event = kopf.on.event
    on_event(names.GROUP, names.VERSION, names.MODEL_PLURAL, registry=registry)(model_event)
    on_event(names.GROUP, names.VERSION, names.RUNTIME_PLURAL, registry=registry)(runtime_event)
    on_event(names.GROUP, names.VERSION, names.MODELCACHE_PLURAL, registry=registry)(cache_event)
    on_event(names.GROUP, names.VERSION, names.MODELCATALOG_PLURAL, registry=registry)(catalog_event)
    on_event(names.GROUP, names.VERSION, names.LORAADAPTER_PLURAL, registry=registry)(adapter_event)
    on_event("apps", "v1", "deployments", labels=BACKEND_LABELS, registry=registry)(deployment_event)
    on_event("", "v1", "pods", labels=BACKEND_LABELS, registry=registry)(pod_event)
    on_event(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        when=lambda name, **_: name == SCALEDOBJECT_CRD,
        registry=registry,
    )(crd_event)


def keda_installed(kube: Kube) -> bool:
    crd = kube.get_or_none(path("apiextensions.k8s.io/v1", "CustomResourceDefinition", None, SCALEDOBJECT_CRD))
    return crd is not None
