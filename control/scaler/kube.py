"""The scaler's Kubernetes adapters: a read-only Model watch and the builtin engine's scale writes.

:func:`model_watch` lists and watches `wakegate.io/v1alpha1` Models (one namespace or all)
in a thread and hands the whole valid set to the event loop on every change.
:class:`BuiltinEngine` applies the verdicts of models with ``spec.scaling.engine: builtin``
by patching their `wg-<model>` Deployment's scale subresource, only while this scaler holds
the Lease and only when the desired count differs from the one it last saw or wrote.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pydantic import ValidationError

from wakegate.control.k8s import names
from wakegate.control.k8s.client import Kube, KubeError, path
from wakegate.control.k8s.objects import model_from_object
from wakegate.control.k8s.watch import ListWatch
from wakegate.control.scaler.metrics import ScalerMetrics
from wakegate.control.scaling.core import Verdict
from wakegate.control.schema import Model, ScalingEngine

log = logging.getLogger("wakegate.scaler.kube")

#: Seconds before a failed scale write is tried again.
RETRY_SECONDS = 2.0


def valid_models(watch: ListWatch) -> list[Model]:
    """The watched Models the schema accepts; one warning for each that it does not."""
    models = []
    for obj in watch.items():
        try:
            models.append(model_from_object(obj))
        except ValidationError as exc:
            meta = obj.get("metadata") or {}
            log.warning("ignoring Model %s/%s: %s", meta.get("namespace"), meta.get("name"), exc.errors()[:1])
    return models


def model_watch(
    kube: Kube, namespace: str | None, loop: asyncio.AbstractEventLoop, on_models: Callable[[list[Model]], None]
) -> ListWatch:
    """A watch of the Models (one namespace, or all) that hands every valid set to the loop."""

    def changed(watch: ListWatch) -> None:
        loop.call_soon_threadsafe(on_models, valid_models(watch))

    return ListWatch(kube, "models", path(names.API_VERSION, "Model", namespace), on_change=changed)


def _scale_path(model: Model) -> str:
    return path("apps/v1", "Deployment", model.metadata.namespace, names.backend_name(model.name)) + "/scale"


class BuiltinEngine:
    def __init__(self, kube: Kube, metrics: ScalerMetrics, on_retry: Callable[[], None]) -> None:
        self._kube = kube
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
        scale = self._kube.get_or_none(_scale_path(model))
        return int(((scale or {}).get("spec") or {}).get("replicas") or 0)

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
                except (KubeError, OSError) as exc:
                    result = "not_found" if isinstance(exc, KubeError) and exc.status == 404 else "error"
                    self._metrics.scale_patches.labels(key, result).inc()
                    log.warning("scale %s to %d failed: %s", key, wanted, exc)
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
        self._kube.merge_patch(_scale_path(model), {"spec": {"replicas": replicas}}, names.SCALER_FIELD_MANAGER)
