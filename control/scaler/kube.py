"""The scaler's Kubernetes adapters: read-only Model and Pod watches, and what it writes while it leads.

:func:`model_watch` lists and watches `wakegate.io/v1alpha1` Models (one namespace or all)
in a thread and hands the whole valid set to the event loop on every change.
:func:`pod_watch` does the same for the backend pods, as a count per model of the pods that
still exist (terminating ones included): the scaling core starts a GPU group's incoming member
only once the outgoing member's count is 0, i.e. its pods are deleted from the API.
:class:`BuiltinEngine` applies the verdicts of models with ``spec.scaling.engine: builtin``
by patching their `wg-<model>` Deployment's scale subresource, and :class:`WaitingWriter`
writes the `status.waitingFor` of GPU-group members; both only while this scaler holds the
Lease and only when the value differs from the one last seen or written.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from wakegate.control.k8s import names
from wakegate.control.k8s.client import Kube, KubeError, path
from wakegate.control.k8s.objects import model_from_object
from wakegate.control.k8s.watch import ListWatch
from wakegate.control.scaler.metrics import ScalerMetrics
from wakegate.control.scaling.core import Verdict
from wakegate.control.schema import Model, ScalingEngine

log = logging.getLogger("wakegate.scaler.kube")

#: Seconds before a failed write is tried again.
RETRY_SECONDS = 2.0
#: Seconds before a write whose target did not exist (a Model's Deployment the operator has not made
#: yet) is tried again without news of it; the Model's next event (the operator writes its status
#: once it applied the Deployment) tries it at once.
ABSENT_RETRY_SECONDS = 30.0
#: The backend pods the operator renders (the selector of the pod watch).
BACKEND_SELECTOR = f"{names.LABEL_COMPONENT}=model-backend,{names.LABEL_MANAGED_BY}={names.MANAGED_BY}"


class ParsedModels:
    """The watched Models, parsed again only where an object changed what a Model is made of.

    A Model is its metadata's name, namespace and labels and its spec: the object's generation
    (which the API server moves on every spec change) and its labels tell when to parse again,
    so the operator's status writes (several per Model) cost a dictionary lookup each, not a
    parse of every Model. After a watch event only the object it was about is looked at (the
    watch's `changed`), so an event that changes no Model costs O(1) whatever the number of
    Models; only a list looks at all of them. Calling it gives the valid Models when they
    changed since the last call (one warning for each invalid one, when it changes), else None.
    """

    def __init__(self) -> None:
        #: (namespace, name) -> (what it was parsed from, the Model or None when invalid)
        self._cache: dict[tuple[str, str], tuple[tuple[Any, ...], Model | None]] = {}
        self._delivered = False

    def __call__(self, watch: ListWatch) -> list[Model] | None:
        if watch.changed is None or not self._delivered:
            changed = not self._delivered
            seen = set()
            for obj in watch.items():
                key, made_of = self._made_of(obj)
                seen.add(key)
                changed = self._parse(key, made_of, obj) or changed
            for key in [k for k in self._cache if k not in seen]:
                del self._cache[key]
                changed = True
        else:
            key = watch.changed
            found = watch.get(key[1], key[0])
            gone = found is None and self._cache.pop(key, None) is not None
            changed = gone or (found is not None and self._parse(*self._made_of(found), found))
        self._delivered = True
        if not changed:
            return None
        return [model for _, model in self._cache.values() if model is not None]

    @staticmethod
    def _made_of(obj: Mapping[str, Any]) -> tuple[tuple[str, str], tuple[Any, ...]]:
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        made_of = (
            meta.get("uid"),
            meta.get("generation") or meta.get("resourceVersion"),
            tuple(sorted((meta.get("labels") or {}).items())),
        )
        return key, made_of

    def _parse(self, key: tuple[str, str], made_of: tuple[Any, ...], obj: Mapping[str, Any]) -> bool:
        """Parse the object again when what a Model is made of moved; whether it did."""
        hit = self._cache.get(key)
        if hit is not None and hit[0] == made_of:
            return False
        try:
            model = model_from_object(obj)
        except ValidationError as exc:
            log.warning("ignoring Model %s/%s: %s", key[0], key[1], exc.errors()[:1])
            model = None
        self._cache[key] = (made_of, model)
        return True


def model_watch(
    kube: Kube,
    namespace: str | None,
    loop: asyncio.AbstractEventLoop,
    on_models: Callable[[list[Model]], None],
    on_event: Callable[[str], None] = lambda _key: None,
) -> ListWatch:
    """A watch of the Models (one namespace, or all) that hands each changed valid set to the loop,
    and the key (`namespace/name`) of the Model each event was about to `on_event` (status
    writes included)."""
    parsed = ParsedModels()

    def changed(watch: ListWatch) -> None:
        models = parsed(watch)
        if models is not None:
            loop.call_soon_threadsafe(on_models, models)
        if watch.changed is not None:
            loop.call_soon_threadsafe(on_event, f"{watch.changed[0]}/{watch.changed[1]}")

    return ListWatch(kube, "models", path(names.API_VERSION, "Model", namespace), on_change=changed)


def _scale_path(model: Model) -> str:
    return path("apps/v1", "Deployment", model.metadata.namespace, names.backend_name(model.name)) + "/scale"


class _LeaderWrites:
    """One value per model written to the cluster while this scaler leads: the newest wanted one,
    once per change (a write in flight is followed by the newest value), retried after a failure.

    A write whose target does not exist (404) waits for news of the model (:meth:`model_event`) or
    ABSENT_RETRY_SECONDS, logged at INFO (a missing Deployment is the operator's pace, not a
    failure): a thousand new Models whose Deployments the operator has not made yet are a
    thousand writes, not a thousand every RETRY_SECONDS.
    """

    what = "value"

    def __init__(self, on_retry: Callable[[], None]) -> None:
        self._on_retry = on_retry
        self.leader = False
        self.models: dict[str, Model] = {}
        #: key -> value last read from or written to the cluster.
        self._known: dict[str, Any] = {}
        self._busy: set[str] = set()
        self._wanted: dict[str, Any] = {}
        #: key -> loop time until which its target is taken to be missing (no write tried)
        self._absent: dict[str, float] = {}
        #: key -> events seen about it (:meth:`model_event`), to tell a 404 older than the news
        self._events: dict[str, int] = {}
        #: the one timer that asks for an evaluation once missing targets may be tried again
        self._absent_timer: asyncio.TimerHandle | None = None

    def set_leader(self, leader: bool) -> None:
        self.leader = leader
        # A new leader trusts nothing it saw while following.
        self._known.clear()
        self._on_retry()

    def _settled(self, key: str, value: Any) -> bool:
        return key in self._known and self._known[key] == value

    def _want(self, key: str, model: Model, value: Any) -> None:
        self._wanted[key] = value
        if not self.leader or key in self._busy or self._settled(key, value) or self._missing(key):
            return
        self._busy.add(key)
        asyncio.get_running_loop().create_task(self._write(key, model))

    def _missing(self, key: str) -> bool:
        until = self._absent.get(key)
        if until is None:
            return False
        if asyncio.get_running_loop().time() < until:
            return True
        del self._absent[key]
        return False

    def model_event(self, key: str) -> None:
        """The cluster said something about model `key` (any event of its Model): a write held back
        because its target was missing is tried now."""
        self._events[key] = self._events.get(key, 0) + 1
        model = self.models.get(key)
        if self._absent.pop(key, None) is not None and model is not None and key in self._wanted:
            self._want(key, model, self._wanted[key])

    def forget(self, keys: Iterable[str]) -> None:
        """Models no longer watched."""
        for key in keys:
            self._absent.pop(key, None)
            self._events.pop(key, None)

    def _retry_absent_later(self) -> None:
        """One timer for all missing targets: at the earliest time one may be tried again, an
        evaluation (which tries it), and again while any is left."""
        if self._absent_timer is not None or not self._absent:
            return
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self._absent_timer = None
            self._on_retry()
            self._retry_absent_later()

        delay = max(ABSENT_RETRY_SECONDS / 10, min(self._absent.values()) - loop.time())
        self._absent_timer = loop.call_later(delay, fire)

    async def _write(self, key: str, model: Model) -> None:
        retry = False
        try:
            while self.leader and not self._settled(key, wanted := self._wanted[key]):
                seen = self._events.get(key, 0)
                try:
                    await asyncio.to_thread(self._patch, model, wanted)
                except (KubeError, OSError) as exc:
                    self._failed(key, exc)
                    if isinstance(exc, KubeError) and exc.status == 404 and self._events.get(key, 0) == seen:
                        if key not in self._absent:
                            log.info("%s of %s (%s) not written yet: %s", self.what, key, wanted, exc)
                        self._absent[key] = asyncio.get_running_loop().time() + ABSENT_RETRY_SECONDS
                        self._retry_absent_later()
                    else:
                        log.warning("writing %s of %s (%s) failed: %s", self.what, key, wanted, exc)
                        retry = True
                    return
                self._known[key] = wanted
                self._written(key, wanted)
        finally:
            self._busy.discard(key)
            if retry:
                asyncio.get_running_loop().call_later(RETRY_SECONDS, self._on_retry)

    def _patch(self, model: Model, value: Any) -> None:
        raise NotImplementedError

    def _failed(self, key: str, exc: Exception) -> None:
        """A write failed (logged by the caller)."""

    def _written(self, key: str, value: Any) -> None:
        """A write succeeded."""


class BuiltinEngine(_LeaderWrites):
    """Replicas of `engine: builtin` models, through their Deployment's scale subresource."""

    what = "replicas"

    def __init__(self, kube: Kube, metrics: ScalerMetrics, on_retry: Callable[[], None]) -> None:
        super().__init__(on_retry)
        self._kube = kube
        self._metrics = metrics

    def current_replicas(self, model: Model) -> int:
        """The Deployment's spec.replicas now (0 when it does not exist yet)."""
        scale = self._kube.get_or_none(_scale_path(model))
        return int(((scale or {}).get("spec") or {}).get("replicas") or 0)

    def apply(self, verdicts: dict[str, Verdict]) -> None:
        """Called on the loop with every evaluation; starts writes for changed builtin models."""
        for key, verdict in verdicts.items():
            model = self.models.get(key)
            if model is not None and model.spec.scaling.engine == ScalingEngine.BUILTIN:
                self._want(key, model, verdict.replicas)

    def _patch(self, model: Model, replicas: int) -> None:
        self._kube.merge_patch(_scale_path(model), {"spec": {"replicas": replicas}}, names.SCALER_FIELD_MANAGER)

    def _failed(self, key: str, exc: Exception) -> None:
        result = "not_found" if isinstance(exc, KubeError) and exc.status == 404 else "error"
        self._metrics.scale_patches.labels(key, result).inc()

    def _written(self, key: str, value: Any) -> None:
        self._metrics.scale_patches.labels(key, "ok").inc()
        log.info("scaled %s to %d replicas", key, value)


class WaitingWriter(_LeaderWrites):
    """`status.waitingFor` of GPU-group members (any engine): the peer a demanded member waits for.

    The operator owns the rest of the status and turns this field into the `Waiting` phase; a
    merge patch of this one key leaves its fields alone. Written once per change, and once for
    every member when this scaler becomes the leader (a patch that changes nothing is no write).
    """

    what = "status.waitingFor"

    def __init__(self, kube: Kube, on_retry: Callable[[], None]) -> None:
        super().__init__(on_retry)
        self._kube = kube

    def apply(self, verdicts: dict[str, Verdict]) -> None:
        for key, verdict in verdicts.items():
            model = self.models.get(key)
            if model is not None and model.spec.gpu.shared:
                self._want(key, model, verdict.waiting_for)

    def _patch(self, model: Model, peer: str | None) -> None:
        target = path(names.API_VERSION, "Model", model.metadata.namespace, model.name) + "/status"
        try:
            self._kube.merge_patch(target, {"status": {names.STATUS_WAITING_FOR: peer}}, names.SCALER_FIELD_MANAGER)
        except KubeError as exc:
            if exc.status != 404:  # the Model is gone: nothing to say
                raise

    def _written(self, key: str, value: Any) -> None:
        if value is not None:
            log.info("%s waits for GPU group peer %s", key, value)


def _pod_phase(pod: dict[str, Any]) -> dict[str, Any]:
    """What the pod count needs of a pod: its name, labels, whether it is being deleted, its phase."""
    meta = pod.get("metadata") or {}
    return {
        "metadata": {k: meta[k] for k in ("name", "namespace", "labels", "deletionTimestamp") if k in meta},
        "status": {"phase": (pod.get("status") or {}).get("phase")},
    }


def pods_per_model(pods: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Backend pods per model key that may hold an accelerator: from creation until they are
    deleted from the API. A pod being deleted counts whatever its phase (its containers ending
    is not its end: the kubelet deletes it once everything is released); only a pod that ended
    on its own (Succeeded or Failed, e.g. evicted) and is not being deleted does not count."""
    counts: dict[str, int] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        key = names.owning_model_key(meta)
        ended = (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")
        if key is None or (ended and not meta.get("deletionTimestamp")):
            continue
        counts[key] = counts.get(key, 0) + 1
    return counts


def pod_watch(
    kube: Kube, namespace: str | None, loop: asyncio.AbstractEventLoop, on_counts: Callable[[dict[str, int]], None]
) -> ListWatch:
    """A watch of the backend pods (one namespace, or all) that hands the count per model to the loop."""

    def changed(watch: ListWatch) -> None:
        loop.call_soon_threadsafe(on_counts, pods_per_model(watch.items()))

    return ListWatch(
        kube,
        "pods",
        path("v1", "Pod", namespace),
        query={"labelSelector": BACKEND_SELECTOR},
        convert=_pod_phase,
        on_change=changed,
    )
