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

The handlers are registered in watches.py; the ModelCatalog, tag-pinning and LoRAAdapter parts of
the Reconciler live in catalogs.py, pinner.py and lora_reconcile.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from pydantic import ValidationError

from wakegate.control.backends import BACKENDS
from wakegate.control.delivery.registry import RegistrySettings
from wakegate.control.k8s import names
from wakegate.control.k8s.adapters import Selection, select
from wakegate.control.k8s.client import Kube, KubeError, path
from wakegate.control.k8s.objects import (
    model_from_object,
    modelcache_from_object,
    rfc3339_now,
)
from wakegate.control.operator import pinning
from wakegate.control.operator import render as rnd
from wakegate.control.operator.catalogs import CatalogReconcile
from wakegate.control.operator.keys import ADAPTER_KEY, CACHE_KEY, CATALOG_KEY
from wakegate.control.operator.lora_loading import RuntimeLoader
from wakegate.control.operator.lora_reconcile import LoraReconcile
from wakegate.control.operator.metrics import OperatorMetrics
from wakegate.control.operator.pinner import TagPinner
from wakegate.control.operator.status import Observed, compute, failed_pods, routing_path_status, swap_holder
from wakegate.control.operator.weights import cache_summary, weights_for
from wakegate.control.runtime_schema import InferenceRuntime
from wakegate.control.schema import LoRAAdapter, Model

log = logging.getLogger("wakegate.operator")

SCALEDOBJECT_CRD = "scaledobjects.keda.sh"
BACKEND_LABELS = {names.LABEL_COMPONENT: "model-backend", names.LABEL_MANAGED_BY: names.MANAGED_BY}


def _replicas_owned_elsewhere(deployment: Mapping[str, Any]) -> bool:
    """Whether a manager other than the operator's apply owns spec.replicas (the scaler, KEDA's HPA)."""
    for entry in deployment.get("metadata", {}).get("managedFields") or []:
        if entry.get("manager") == names.FIELD_MANAGER and entry.get("operation") == "Apply":
            continue
        if "f:replicas" in ((entry.get("fieldsV1") or {}).get("f:spec") or {}):
            return True
    return False


class Reconciler(LoraReconcile, TagPinner, CatalogReconcile):
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
        status = compute(observed, previous, rfc3339_now())
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
        summary = cache_summary(body, previous, rfc3339_now(), invalid)
        if all(previous.get(k) == v for k, v in summary.items()):
            return
        await self._patch_status("ModelCache", body, summary, {**previous, **summary},
                                 lambda: self.caches.get(namespace, {}).get(name))

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


def _record(store: dict[str, dict[str, Any]], key: str, event_type: str | None, body: Mapping[str, Any]) -> None:
    """Keep the newest copy of an object, or forget it when it was deleted."""
    if event_type == "DELETED":
        store.pop(key, None)
    else:
        store[key] = _plain(body)


def _plain(body: Mapping[str, Any]) -> dict[str, Any]:
    """A detached copy of a Kopf body (Kopf reuses and mutates its views)."""
    return {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in body.items()}
