"""The native path's demand on a cluster: what this gateway pod's Envoy routes alone.

A request on a native route (`routing.path: native`, docs/decisions.md "The native path") never
reaches extproc, so without this its model would look idle to the scaler while it serves. With
`--envoy-admin` (the chart sets it, Envoy's admin API being on the pod's loopback), extproc polls
its own Envoy's counters of the models that ask for the native path every POLL_SECONDS and adds
what only Envoy saw (wakegate.envoycounters) to the in-flight counts of its demand reports: one
report per gateway pod, so nothing about the scaler's bookkeeping changes. Envoy's counts include
the requests extproc routed itself; those are its own `in_flight`, subtracted per model.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from wakegate.envoycounters import POLL_SECONDS, STATS_QUERY, NativeInFlight, parse_counters, stat_name
from wakegate.extproc.gateway import Gateway

log = logging.getLogger("wakegate.extproc.native")

#: How long native counts outlive an Envoy that stopped answering, seconds (the scaler forgets a
#: silent gateway after as long): a counted request must not keep a model awake for ever.
STALE_SECONDS = 10.0


class NativeCounts:
    """Native requests in flight per model, from this gateway's Envoy, kept in `in_flight`."""

    def __init__(self, envoy_admin: str, gateway: Gateway, on_change: Callable[[], None] = lambda: None) -> None:
        self.envoy_admin = envoy_admin
        self.gateway = gateway
        self.on_change = on_change
        self._counts = NativeInFlight()
        self._answered_at: float | None = None
        self._failing = False

    @property
    def in_flight(self) -> dict[str, int]:
        """Model key -> requests Envoy routes natively now (only models with some); kept in the
        gateway, whose status and queue views add them to its own."""
        return self.gateway.native_in_flight

    def reported(self) -> dict[str, int]:
        """What the demand reports say is in flight: extproc's own requests plus the native ones."""
        if not self.in_flight:
            return self.gateway.in_flight
        out = dict(self.gateway.in_flight)
        for key, count in self.in_flight.items():
            out[key] = out.get(key, 0) + count
        return out

    def _keys(self) -> list[str]:
        keys = [key for key, route in self.gateway.table.routes.items() if route.path == "native"]
        # A model that left the native path (or the route table) may still have native requests
        # finishing in Envoy: it stays counted until they are done.
        return keys + [key for key in self.in_flight if key not in keys]

    async def poll(self, session: aiohttp.ClientSession, now: float) -> None:
        """One poll of Envoy's counters; `now` is the loop's time."""
        keys = self._keys()
        if not keys:
            return
        try:
            async with session.get(STATS_QUERY) as response:
                response.raise_for_status()
                body = await response.json()
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            if not self._failing:
                log.warning("envoy admin %s unanswered (%s): native requests not counted", self.envoy_admin, exc)
            self._failing = True
            if self.in_flight and (self._answered_at is None or now - self._answered_at > STALE_SECONDS):
                self._set({})
            return
        if self._failing:
            log.info("envoy admin %s answers again", self.envoy_admin)
        self._failing = False
        self._answered_at = now
        stats = body.get("stats", []) if isinstance(body, dict) else []
        counters = parse_counters(stats, {stat_name(key): key for key in keys})
        native = self._counts.update(counters, keys, self.gateway.in_flight)
        self._set({key: count for key, count in native.items() if count})

    def _set(self, in_flight: dict[str, int]) -> None:
        if in_flight != self.in_flight:
            self.gateway.native_in_flight = in_flight
            self.on_change()

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=2)
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession(base_url=f"http://{self.envoy_admin}", timeout=timeout) as session:
            while True:
                await asyncio.sleep(POLL_SECONDS)
                await self.poll(session, loop.time())
