"""Versioned snapshot cache: the one consistent set of resources every xDS stream serves.

Modelled on go-control-plane's SnapshotCache, simplified to one snapshot shared
by all nodes (Envoy and extproc subscribe to different types of the same set).
Setting a snapshot wakes every stream; each stream decides per type whether the
content changed for the names it watches.
"""

from __future__ import annotations

import asyncio
import logging

from wakegate.control.feeder.resources import Resources

log = logging.getLogger("wakegate.xds.cache")


class SnapshotCache:
    def __init__(self) -> None:
        self._snapshot = Resources(by_type={})
        self._serial = 0
        self._changed = asyncio.Condition()

    @property
    def snapshot(self) -> Resources:
        return self._snapshot

    @property
    def serial(self) -> int:
        """Increases by one on every set; streams compare it to know they are behind."""
        return self._serial

    async def set(self, snapshot: Resources) -> None:
        async with self._changed:
            self._snapshot = snapshot
            self._serial += 1
            self._changed.notify_all()

    async def wait_newer(self, serial: int) -> int:
        """Return once the cache serial exceeds `serial`; gives the new serial."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._serial > serial)
            return self._serial
