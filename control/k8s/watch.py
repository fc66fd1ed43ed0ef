"""List, then watch: a thread that keeps a read-only copy of one collection current.

The one list+watch loop for components that do not run Kopf (the scaler's Models, the
scheduler extender's Nodes and bench results). It lists the collection, then watches from
the list's resourceVersion; a watch that ends is resumed from the last version seen, one
that expired (410) or broke is answered with a fresh list after a short pause. Objects are
kept as plain JSON (after an optional `convert`), keyed by namespace and name; `on_change`
runs in the watch thread after every list and every event, and `changed` then says what moved
(the one object an event was about, or None after a list: anything), so a reader can keep its
own work proportional to the change.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from wakegate.control.k8s.client import Kube, KubeError

log = logging.getLogger("wakegate.k8s.watch")

#: Server-side length of one watch request; the watch resumes from its last version afterwards.
WATCH_SECONDS = 60
#: Pause before listing again after an error.
RETRY_SECONDS = 2.0

Key = tuple[str, str]
Convert = Callable[[dict[str, Any]], dict[str, Any]]


def object_key(obj: Mapping[str, Any]) -> Key:
    meta = obj["metadata"]
    return str(meta.get("namespace") or ""), str(meta["name"])


class ListWatch:
    """Objects of one collection (`resource`: a list path, `query`: selectors), kept current by a watch."""

    def __init__(
        self,
        kube: Kube,
        what: str,
        resource: str,
        *,
        query: Mapping[str, str] | None = None,
        convert: Convert = lambda obj: obj,
        on_change: Callable[[ListWatch], None] = lambda _watch: None,
    ) -> None:
        self.kube = kube
        self.what = what
        self.resource = resource
        self.query = dict(query or {})
        self.convert = convert
        self.on_change = on_change
        self.synced = threading.Event()
        self._items: dict[Key, dict[str, Any]] = {}
        self._lock = threading.Lock()
        #: During `on_change`: the key of the object the event was about; None after a list.
        self.changed: Key | None = None

    def get(self, name: str, namespace: str = "") -> dict[str, Any] | None:
        with self._lock:
            return self._items.get((namespace, name))

    def items(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._items.values())

    def _list(self) -> str:
        listing = self.kube.request("GET", self.resource, query=self.query or None)
        items = {object_key(obj): self.convert(obj) for obj in listing.get("items") or []}
        with self._lock:
            self._items = items
        self.synced.set()
        self.changed = None
        self.on_change(self)
        return str(listing["metadata"]["resourceVersion"])

    def _apply(self, event: Mapping[str, Any]) -> str | None:
        """Apply one event; returns the version it carries, None when the watch must list again."""
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            log.info("%s watch expired (%s); listing again", self.what, obj.get("message", obj.get("code")))
            return None
        version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
        if kind == "BOOKMARK":
            return version
        key = object_key(obj)
        with self._lock:
            if kind == "DELETED":
                self._items.pop(key, None)
            else:
                self._items[key] = self.convert(obj)
        self.changed = key
        self.on_change(self)
        return version

    def run(self, stop: threading.Event) -> None:
        """List and watch until `stop` is set (checked between events and watch requests)."""
        while not stop.is_set():
            try:
                version: str | None = self._list()
                while version is not None and not stop.is_set():
                    for event in self.kube.watch(self.resource, version, self.query, WATCH_SECONDS):
                        seen = self._apply(event)
                        if seen is None:
                            version = None
                            break
                        version = seen or version
                        if stop.is_set():
                            break
            except (KubeError, OSError, ValueError, KeyError) as exc:
                if stop.is_set():
                    return
                log.warning("%s watch failed (%s); listing again in %.0fs", self.what, exc, RETRY_SECONDS)
                stop.wait(RETRY_SECONDS)

    def start(self, stop: threading.Event) -> threading.Thread:
        thread = threading.Thread(target=self.run, args=(stop,), name=f"watch-{self.what}", daemon=True)
        thread.start()
        return thread
