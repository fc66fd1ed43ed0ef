"""Versioned snapshot cache: the one consistent set of resources every xDS stream serves.

Modelled on go-control-plane's SnapshotCache: one base snapshot, plus a view per
gateway (node id) whose endpoints are gated by that gateway's own acknowledgements
(Envoy and extproc subscribe to different types of the same view). A node without a
view of its own gets the base. Setting a snapshot wakes every stream; each stream
decides per type whether the content changed for the names it watches.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from wakegate.control.feeder.resources import Resources, keep_digests_of

log = logging.getLogger("wakegate.xds.cache")


class SnapshotCache:
    def __init__(self) -> None:
        self._snapshot = Resources(by_type={})
        self._views: Mapping[str, Resources] = {}
        self._serial = 0
        self._changed = asyncio.Condition()

    @property
    def snapshot(self) -> Resources:
        return self._snapshot

    def view(self, node: str) -> Resources:
        """What the streams of one gateway are served: its own view, else the base snapshot."""
        return self._views.get(node, self._snapshot)

    @property
    def serial(self) -> int:
        """Increases by one on every set; streams compare it to know they are behind."""
        return self._serial

    async def set(self, snapshot: Resources, views: Mapping[str, Resources] | None = None) -> None:
        async with self._changed:
            self._snapshot = snapshot
            self._views = dict(views or {})
            self._serial += 1
            keep_digests_of([snapshot, *self._views.values()])
            self._changed.notify_all()

    async def wait_newer(self, serial: int) -> int:
        """Return once the cache serial exceeds `serial`; gives the new serial."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._serial > serial)
            return self._serial
