"""The node agent's prewarm loop: ModelCaches -> pulls into this node's cache -> status and labels.

Runs in its own thread with its own event loop, beside the GPU labelling loop. Every round
(`--interval`) it reads this Node's labels, decides from the mirrored ModelCaches and Models
which sources this node should hold (`caching.wants`), starts one pull per wanted source with
`delivery.resolve()` (the cache's flock makes concurrent pulls of one digest share a download,
in this process and any other on the node), and then

- server-side-applies this node's entries of each ModelCache's `status.nodes` (field manager
  `wakegate-agent/<node>`), only when they changed: Pending, Pulling with bytes, Ready with
  digest, size and file, Failed with the delivery error's reason and message;
- keeps a lease on every entry a ModelCache wants, so the cache's eviction never removes it;
- labels the Node with one `cache.wakegate.io/sha256-…` label per entry its cache holds ready.

A failed pull stays Failed (reason and message) and is tried again after `retry_seconds`.
Registry credentials come from the Secret a ModelCache names; they exist only in a private
temporary file (mode 0600 under $TMPDIR, a memory-backed emptyDir in the chart) for the pull's duration, never in
logs, arguments or status.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from wakegate.control.agent.caching import Entry, EntryPhase, label_patch, status_body, wants
from wakegate.control.delivery.cache import Cache
from wakegate.control.delivery.errors import DeliveryError
from wakegate.control.delivery.progress import Phase, Progress
from wakegate.control.delivery.resolver import Access, Resolved, resolve
from wakegate.control.delivery_schema import ModelCache
from wakegate.control.k8s import names
from wakegate.control.k8s.client import Kube, KubeError, path
from wakegate.control.k8s.objects import model_from_object, modelcache_from_object
from wakegate.control.k8s.watch import ListWatch
from wakegate.control.schema import Model

log = logging.getLogger("wakegate.agent")

CacheKey = tuple[str, str]
#: Docker config key in a `kubernetes.io/dockerconfigjson` Secret (and the older `.dockercfg` is not read).
DOCKER_CONFIG_KEY = ".dockerconfigjson"


def _rfc3339(unix: float) -> str:
    return datetime.fromtimestamp(unix, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _private_file(body: bytes) -> Path:
    """`body` in a new file only this user can read, in a new private folder under $TMPDIR
    (the DaemonSet points it at a memory-backed emptyDir)."""
    folder = Path(tempfile.mkdtemp(prefix="wakegate-creds-"))
    config = folder / "config.json"
    fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(body)
    return config


def _typed(kind: str) -> Any:
    def convert(obj: dict[str, Any]) -> dict[str, Any]:
        # List items may come without apiVersion/kind; the typed readers want them.
        return {**obj, "apiVersion": names.API_VERSION, "kind": kind}

    return convert


@dataclass
class Pull:
    """One wanted source of one ModelCache on this node."""

    source: str
    secret: str | None
    entry: Entry = field(default_factory=lambda: Entry(EntryPhase.PENDING))
    task: asyncio.Task[None] | None = None
    resolved: Resolved | None = None
    failed_at: float | None = None

    def release(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
        if self.resolved is not None:
            self.resolved.release()
            self.resolved = None


class Prewarmer:
    def __init__(
        self,
        kube: Kube,
        node: str,
        cache: Cache,
        access: Access,
        *,
        interval: float = 15.0,
        retry_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube = kube
        self.node = node
        self.cache = cache
        self.access = access
        self.interval = interval
        self.retry_seconds = retry_seconds
        self.clock = clock
        self.caches = ListWatch(
            kube, "modelcaches", path(names.API_VERSION, "ModelCache"), convert=_typed("ModelCache")
        )
        self.models = ListWatch(kube, "models", path(names.API_VERSION, "Model"), convert=_typed("Model"))
        self.pulls: dict[tuple[CacheKey, str], Pull] = {}
        #: the last status body applied per ModelCache (an empty one is forgotten once applied)
        self.applied: dict[CacheKey, dict[str, Any]] = {}
        self._node_path = path("v1", "Node", None, node)
        self._manager = names.agent_cache_manager(node)

    # -- the loop --------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """The thread's body: watches, then rounds until `stop`."""
        self.caches.start(stop)
        self.models.start(stop)
        asyncio.run(self._loop(stop))

    async def _loop(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                try:
                    await self.round()
                except (KubeError, OSError) as exc:
                    log.warning("prewarm round on node %s failed: %s", self.node, exc)
                for _ in range(max(1, int(self.interval / 0.2))):
                    if stop.is_set():
                        break
                    await asyncio.sleep(min(0.2, self.interval))
        finally:
            for pull in self.pulls.values():
                pull.release()

    async def round(self) -> None:
        node = await asyncio.to_thread(self.kube.get, self._node_path)
        labels = dict((node.get("metadata") or {}).get("labels") or {})
        wanted = self._wanted(labels)
        self._start_pulls(wanted)
        self._drop_unwanted(wanted)
        await self._write_status(wanted)
        await self._write_labels(labels)

    # -- deciding --------------------------------------------------------------------------------

    def _models(self) -> dict[str, dict[str, Model]]:
        out: dict[str, dict[str, Model]] = {}
        for body in self.models.items():
            try:
                model = model_from_object(body)
            except ValidationError:
                continue
            out.setdefault(model.metadata.namespace or "", {})[model.name] = model
        return out

    def _wanted(self, labels: Mapping[str, str]) -> dict[CacheKey, ModelCache]:
        models = self._models()
        out: dict[CacheKey, ModelCache] = {}
        for body in self.caches.items():
            try:
                cache = modelcache_from_object(body)
            except ValidationError:
                continue
            ns = cache.metadata.namespace or ""
            if wants(cache, labels, models.get(ns, {})):
                out[(ns, cache.metadata.name)] = cache
        return out

    def _start_pulls(self, wanted: Mapping[CacheKey, ModelCache]) -> None:
        now = self.clock()
        for key, cache in wanted.items():
            secret = cache.spec.credentials.name if cache.spec.credentials else None
            for source in cache.spec.sources:
                pull = self.pulls.get((key, source))
                if pull is None or pull.secret != secret:
                    if pull is not None:
                        pull.release()
                    pull = self.pulls[(key, source)] = Pull(source, secret)
                if pull.task is not None and not pull.task.done():
                    continue
                if pull.entry.phase is EntryPhase.READY and pull.entry.digest is not None:
                    if self.cache.record(pull.entry.digest) is not None:
                        continue
                    log.warning("cache entry %s of %s is gone from node %s; pulling it again",
                                pull.entry.digest, source, self.node)
                    pull.release()
                    pull.entry = Entry(EntryPhase.PENDING)
                if pull.failed_at is not None and now - pull.failed_at < self.retry_seconds:
                    continue
                pull.task = asyncio.create_task(self._pull(key[0], pull))

    def _drop_unwanted(self, wanted: Mapping[CacheKey, ModelCache]) -> None:
        for (key, source), pull in list(self.pulls.items()):
            cache = wanted.get(key)
            if cache is None or source not in cache.spec.sources:
                pull.release()
                del self.pulls[(key, source)]

    # -- pulling ---------------------------------------------------------------------------------

    async def _pull(self, namespace: str, pull: Pull) -> None:
        def progress(update: Progress) -> None:
            if update.phase in (Phase.PULLING, Phase.WAITING):
                pull.entry = Entry(EntryPhase.PULLING, done=update.done, total=update.total)

        try:
            async with self._access(namespace, pull.secret) as access:
                resolved = await resolve(pull.source, self.cache, access=access, progress=progress)
        except DeliveryError as exc:
            self._failed(pull, exc.reason, str(exc))
            return
        except OSError as exc:
            self._failed(pull, "cache_error", f"{pull.source}: {exc}")
            return
        except Exception as exc:  # a bug must not leave the entry Pulling forever
            log.exception("prewarm of %s on node %s crashed", pull.source, self.node)
            self._failed(pull, "failed", f"{pull.source}: {type(exc).__name__}")
            return
        record = resolved.record
        if record is None:  # file:// or pvc://: never in a ModelCache (the schema refuses them)
            resolved.release()
            self._failed(pull, "bad_source", f"{pull.source} is not a cached source")
            return
        pull.resolved, pull.failed_at = resolved, None
        pull.entry = Entry(
            EntryPhase.READY,
            digest=record.key,
            size=record.size,
            file=record.primary,
            ready_time=_rfc3339(record.created),
        )
        log.info("node %s holds %s ready: %s (%d bytes%s)", self.node, pull.source, record.key, record.size,
                 ", pulled now" if resolved.pulled else ", already cached")

    def _failed(self, pull: Pull, reason: str, message: str) -> None:
        pull.failed_at = self.clock()
        again = pull.entry.phase is EntryPhase.FAILED and pull.entry.message == message
        pull.entry = Entry(EntryPhase.FAILED, reason=reason, message=message)
        # One warning per failure; the same failure on every retry is only a debug line.
        log.log(logging.DEBUG if again else logging.WARNING, "node %s cannot prewarm %s: %s (%s)",
                self.node, pull.source, message, reason)

    @contextlib.asynccontextmanager
    async def _access(self, namespace: str, secret: str | None) -> AsyncIterator[Access]:
        """The process's access, with the Secret's Docker config in a private file while it is used."""
        if secret is None:
            yield self.access
            return
        try:
            body = await asyncio.to_thread(self.kube.get, path("v1", "Secret", namespace, secret))
        except KubeError as exc:
            why = "does not exist" if exc.status == 404 else f"cannot be read ({exc.status})"
            raise DeliveryError(f"credentials Secret {namespace}/{secret} {why}", "bad_credentials") from None
        encoded = (body.get("data") or {}).get(DOCKER_CONFIG_KEY)
        if not encoded:
            raise DeliveryError(f"credentials Secret {namespace}/{secret} has no {DOCKER_CONFIG_KEY} key",
                                "bad_credentials")
        config = await asyncio.to_thread(_private_file, base64.b64decode(encoded))
        try:
            yield replace(self.access, registry=replace(self.access.registry, docker_config=config))
        finally:
            shutil.rmtree(config.parent, ignore_errors=True)

    # -- writing ---------------------------------------------------------------------------------

    async def _write_status(self, wanted: Mapping[CacheKey, ModelCache]) -> None:
        entries: dict[CacheKey, dict[str, Entry]] = {key: {} for key in wanted}
        for (key, source), pull in self.pulls.items():
            entries.setdefault(key, {})[source] = pull.entry
        for key in set(entries) | set(self.applied):
            ns, name = key
            body = status_body(ns, name, self.node, entries.get(key, {}))
            if self.applied.get(key) == body:
                continue
            try:
                await asyncio.to_thread(self.kube.apply_status, body, self._manager)
            except KubeError as exc:
                if exc.status != 404:
                    raise
            if key in wanted:
                self.applied[key] = body
            else:
                self.applied.pop(key, None)

    async def _write_labels(self, labels: Mapping[str, str]) -> None:
        held = await asyncio.to_thread(lambda: [info.record.key for info in self.cache.entries()])
        patch = label_patch(held, labels)
        if patch is not None:
            await asyncio.to_thread(self.kube.merge_patch, self._node_path, patch, names.AGENT_FIELD_MANAGER)
            log.info("node %s cache labels: %s", self.node, patch["metadata"]["labels"])
