"""The scaler's Kubernetes adapters: a read-only Model watch and the builtin engine's scale writes.

:class:`ModelWatch` lists and watches `wakegate.io/v1alpha1` Models (one
namespace or all) in a thread and hands the whole valid set to the event loop
on every change. :class:`BuiltinEngine` applies the verdicts of models with
``spec.scaling.engine: builtin`` by PATCHing their `wg-<model>` Deployment's
scale subresource, only while this scaler holds the Lease and only when the
desired count differs from the one it last saw or wrote.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from kubernetes import client, watch
from kubernetes.client.rest import ApiException
from pydantic import ValidationError

from wakegate.control.k8s.names import GROUP, MODEL_PLURAL, SCALER_FIELD_MANAGER, VERSION, backend_name
from wakegate.control.scaler.metrics import ScalerMetrics
from wakegate.control.scaling.core import Verdict
from wakegate.control.schema import Model, ScalingEngine

log = logging.getLogger("wakegate.scaler.kube")

#: Seconds before a failed scale write is tried again.
RETRY_SECONDS = 2.0


def parse_model(obj: dict[str, Any]) -> Model | None:
    body = {k: obj.get(k) for k in ("apiVersion", "kind", "metadata", "spec")}
    try:
        return Model.model_validate(body)
    except ValidationError as exc:
        meta = obj.get("metadata") or {}
        log.warning("ignoring Model %s/%s: %s", meta.get("namespace"), meta.get("name"), exc.errors()[:1])
        return None


class ModelWatch:
    def __init__(
        self,
        api: client.ApiClient,
        namespace: str | None,
        loop: asyncio.AbstractEventLoop,
        on_models: Callable[[list[Model]], None],
    ) -> None:
        self._custom = client.CustomObjectsApi(api)
        self._namespace = namespace
        self._loop = loop
        self._on_models = on_models
        self._objects: dict[tuple[str, str], dict[str, Any]] = {}
        self._watch: watch.Watch | None = None

    def _list(self, **kwargs: Any) -> Any:
        if self._namespace:
            return self._custom.list_namespaced_custom_object(GROUP, VERSION, self._namespace, MODEL_PLURAL, **kwargs)
        return self._custom.list_cluster_custom_object(GROUP, VERSION, MODEL_PLURAL, **kwargs)

    def _publish(self) -> None:
        models = [m for m in map(parse_model, self._objects.values()) if m is not None]
        self._loop.call_soon_threadsafe(self._on_models, models)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                listed = self._list()
                self._objects = {
                    (o["metadata"]["namespace"], o["metadata"]["name"]): o for o in listed.get("items", [])
                }
                self._publish()
                self._watch = watch.Watch()
                version = listed["metadata"]["resourceVersion"]
                for event in self._watch.stream(self._list, resource_version=version, timeout_seconds=300):
                    obj = event["object"]
                    if event["type"] == "ERROR":
                        break
                    ref = (obj["metadata"]["namespace"], obj["metadata"]["name"])
                    if event["type"] == "DELETED":
                        self._objects.pop(ref, None)
                    else:
                        self._objects[ref] = obj
                    self._publish()
            except (ApiException, OSError, ValueError) as exc:
                if stop.is_set():
                    return
                log.warning("Model watch failed, relisting: %s", exc)
                stop.wait(1.0)

    def stop(self) -> None:
        if self._watch is not None:
            self._watch.stop()


class BuiltinEngine:
    def __init__(self, api: client.ApiClient, metrics: ScalerMetrics, on_retry: Callable[[], None]) -> None:
        self._apps = client.AppsV1Api(api)
        self._metrics = metrics
        self._on_retry = on_retry
        self.leader = False
        self.models: dict[str, Model] = {}
        #: key -> replicas last read from or written to the Deployment.
        self._known: dict[str, int] = {}
        self._busy: set[str] = set()
        self._wanted: dict[str, int] = {}

    def current_replicas(self, model: Model) -> int:
        """The Deployment's spec.replicas now (0 when it does not exist yet)."""
        try:
            scale = self._apps.read_namespaced_deployment_scale(backend_name(model.name), model.metadata.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return 0
            raise
        return int(scale.spec.replicas or 0)

    def set_leader(self, leader: bool) -> None:
        self.leader = leader
        # A new leader trusts nothing it saw while following.
        self._known.clear()
        self._on_retry()

    def apply(self, verdicts: dict[str, Verdict]) -> None:
        """Called on the loop with every evaluation; starts writes for changed builtin models."""
        for key, verdict in verdicts.items():
            model = self.models.get(key)
            if model is None or model.spec.scaling.engine != ScalingEngine.BUILTIN:
                continue
            self._wanted[key] = verdict.replicas
            if not self.leader or key in self._busy or self._known.get(key) == verdict.replicas:
                continue
            self._busy.add(key)
            asyncio.get_running_loop().create_task(self._write(key, model))

    async def _write(self, key: str, model: Model) -> None:
        retry = False
        try:
            while self.leader and self._known.get(key) != (wanted := self._wanted[key]):
                try:
                    await asyncio.to_thread(self._patch, model, wanted)
                except (ApiException, OSError) as exc:
                    result = "not_found" if isinstance(exc, ApiException) and exc.status == 404 else "error"
                    self._metrics.scale_patches.labels(key, result).inc()
                    log.warning("scale %s to %d failed: %s", key, wanted, getattr(exc, "reason", exc))
                    retry = True
                    return
                self._known[key] = wanted
                self._metrics.scale_patches.labels(key, "ok").inc()
                log.info("scaled %s to %d replicas", key, wanted)
        finally:
            self._busy.discard(key)
            if retry:
                asyncio.get_running_loop().call_later(RETRY_SECONDS, self._on_retry)

    def _patch(self, model: Model, replicas: int) -> None:
        self._apps.patch_namespaced_deployment_scale(
            backend_name(model.name),
            model.metadata.namespace,
            {"spec": {"replicas": replicas}},
            field_manager=SCALER_FIELD_MANAGER,
        )
