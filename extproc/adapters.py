"""LoRA adapters loaded on demand: where a request for one may go, and holding it until one is loaded.

A route with `adapters_on_demand` (`wakegate up`, engines with a run-time adapter API) lists,
per adapter, the endpoints that hold it now. The gateway never loads anything: `up` owns every
load and unload (two extprocs must not race into double evictions), and learns what is wanted
from the demand reports this module fills (:meth:`AdapterBook.report`):

- :func:`placement` says where a request may go: ``affinity`` (the default) the ready endpoints
  that hold the adapter, among which the model's picking chooses; ``random`` one ready endpoint
  at random, holder or not (a baseline for measurements). No endpoint: the request is held.
- :meth:`AdapterBook.wait` holds a request until the route table shows a holder (for
  ``random``: the endpoint it drew), the adapter's failed loads grow (:class:`AdapterFailed`, a
  503 with the reason), or the deadline passes (:class:`~wakegate.extproc.cold.ActivationTimeout`).
  Woken by route pushes, no polling. Held requests are counted per model against the cold
  queue's bound, and reported as the adapter's (or the endpoint's) queued demand.
- :meth:`AdapterBook.started` / :meth:`AdapterBook.ended` count requests routed with an adapter
  per endpoint: in flight (an adapter in use is never unloaded) and routed so far (a use, however
  short, that the next report shows even when the request ended before it).

Plain asyncio state of one process; no I/O.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from wakegate.extproc.cold import ActivationTimeout, QueueFull
from wakegate.v1 import demand_pb2, routing_pb2

__all__ = ["AdapterBook", "AdapterFailed", "Placement", "adapter_route", "placement"]

RANDOM = "random"


class AdapterFailed(Exception):
    """`up` could not load the adapter (its weights, or the engine refused): the reason is safe to show."""


def adapter_route(route: routing_pb2.ModelRoute, adapter: str | None) -> routing_pb2.LoRAAdapterRoute | None:
    """The LoRAAdapterRoute of `adapter` (a served name) when the route loads adapters on demand."""
    if adapter is None or not route.adapters_on_demand:
        return None
    for entry in route.adapters:
        if entry.served_name == adapter:
            return entry
    return None


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one request may go: `endpoints` to pick among; none: hold until `wanted` holds it
    (`wanted` empty: until any endpoint does)."""

    endpoints: tuple[str, ...]
    wanted: str = ""


def placement(
    route: routing_pb2.ModelRoute, lora: routing_pb2.LoRAAdapterRoute, draw: Callable[[int], int]
) -> Placement:
    """Where a request for `lora` may go now (`draw(n)`: a random index below n, for `random`)."""
    ready = [f"{e.address}:{e.port}" for e in route.endpoints]
    holders = set(lora.endpoints)
    if route.adapter_placement == RANDOM:
        if not ready:
            return Placement(())
        chosen = ready[draw(len(ready))]
        return Placement((chosen,) if chosen in holders else (), chosen)
    return Placement(tuple(ep for ep in ready if ep in holders))


class AdapterBook:
    """Held adapter requests and adapter use per endpoint, of one gateway process."""

    def __init__(self, on_change: Callable[[], None], rng: random.Random | None = None) -> None:
        self._on_change = on_change
        self._rng = rng or random.Random()
        #: model -> (adapter, endpoint or "") -> requests held for it
        self._held: dict[str, dict[tuple[str, str], int]] = {}
        #: model -> (adapter, endpoint) -> [in flight, routed so far]
        self._use: dict[str, dict[tuple[str, str], list[int]]] = {}
        self._routes: Mapping[str, routing_pb2.ModelRoute] = {}
        self._pushed: asyncio.Future[None] | None = None

    def draw(self, n: int) -> int:
        return self._rng.randrange(n)

    def depth(self, key: str) -> int:
        """Requests of model `key` held for an adapter."""
        return sum(self._held.get(key, {}).values())

    # -- use -------------------------------------------------------------------------------------

    def started(self, key: str, adapter: str, endpoint: str) -> None:
        entry = self._use.setdefault(key, {}).setdefault((adapter, endpoint), [0, 0])
        entry[0] += 1
        entry[1] += 1

    def ended(self, key: str, adapter: str, endpoint: str) -> None:
        entry = self._use.get(key, {}).get((adapter, endpoint))
        if entry is not None and entry[0] > 0:
            entry[0] -= 1

    def in_flight(self, key: str, adapter: str, endpoint: str) -> int:
        entry = self._use.get(key, {}).get((adapter, endpoint))
        return entry[0] if entry is not None else 0

    # -- holding ---------------------------------------------------------------------------------

    async def wait(
        self,
        key: str,
        adapter: str,
        wanted: str,
        deadline: float,
        max_queue: int,
        depth_elsewhere: int = 0,
        clock: Callable[[], float] | None = None,
    ) -> Placement:
        """Hold one request of model `key` until its adapter is placeable (see :func:`placement`);
        raises QueueFull (with `depth_elsewhere` cold requests of the model, the queue's bound is
        `max_queue`), AdapterFailed, ActivationTimeout (also when the model or adapter is gone)."""
        if self.depth(key) + depth_elsewhere >= max_queue:
            raise QueueFull(key)
        now = clock or time.monotonic
        route = self._routes.get(key)
        lora = adapter_route(route, adapter) if route is not None else None
        failures_seen = lora.failed_loads if lora is not None else 0
        with self.holding(key, adapter, wanted) as held:
            while True:
                route = self._routes.get(key)
                lora = adapter_route(route, adapter) if route is not None else None
                if route is None or lora is None:
                    raise ActivationTimeout(key)
                if lora.failed_loads > failures_seen:
                    raise AdapterFailed(lora.last_failure or "the adapter could not be loaded")
                ready = {f"{e.address}:{e.port}" for e in route.endpoints}
                if wanted:
                    if wanted in lora.endpoints and wanted in ready:
                        return Placement((wanted,), wanted)
                    if wanted not in ready and ready:  # the drawn endpoint left: draw again
                        wanted = sorted(ready)[self.draw(len(ready))]
                        held.move(wanted)
                        continue
                else:
                    found = tuple(ep for ep in lora.endpoints if ep in ready)
                    if found:
                        return Placement(found)
                remaining = deadline - now()
                if remaining <= 0:
                    raise ActivationTimeout(key)
                if self._pushed is None or self._pushed.done():
                    self._pushed = asyncio.get_running_loop().create_future()
                try:
                    await asyncio.wait_for(asyncio.shield(self._pushed), remaining)
                except TimeoutError:
                    raise ActivationTimeout(key) from None

    def holding(self, key: str, adapter: str, wanted: str = "") -> _Holding:
        """Count one request as held for `adapter` (on `wanted`, or anywhere) while the block runs."""
        return _Holding(self, key, adapter, wanted)

    def _hold(self, key: str, adapter: str, wanted: str) -> None:
        held = self._held.setdefault(key, {})
        held[(adapter, wanted)] = held.get((adapter, wanted), 0) + 1
        self._on_change()

    def _unhold(self, key: str, adapter: str, wanted: str) -> None:
        held = self._held.get(key, {})
        left = held.get((adapter, wanted), 0) - 1
        if left > 0:
            held[(adapter, wanted)] = left
        else:
            held.pop((adapter, wanted), None)
            if not held:
                self._held.pop(key, None)
        self._on_change()

    def on_routes(self, routes: Mapping[str, routing_pb2.ModelRoute]) -> None:
        """A new route table: wake every held request to look again; forget use of endpoints and
        adapters the routes no longer have (which bounds the book)."""
        self._routes = routes
        for key in [k for k in self._use if k not in routes]:
            del self._use[key]
        for key, use in self._use.items():
            route = routes[key]
            names = {a.served_name for a in route.adapters}
            live = {f"{e.address}:{e.port}" for e in route.endpoints}
            for pair in [p for p in use if p[0] not in names or (p[1] not in live and not use[p][0])]:
                del use[pair]
        if self._pushed is not None and not self._pushed.done():
            self._pushed.set_result(None)

    # -- reports ---------------------------------------------------------------------------------

    def report(self) -> dict[str, list[demand_pb2.AdapterDemand]]:
        """model -> what this gateway holds for, and sent to, each of its adapters."""
        out: dict[str, dict[str, demand_pb2.AdapterDemand]] = {}

        def entry(key: str, adapter: str) -> demand_pb2.AdapterDemand:
            by_adapter = out.setdefault(key, {})
            found = by_adapter.get(adapter)
            if found is None:
                found = by_adapter[adapter] = demand_pb2.AdapterDemand(adapter=adapter)
            return found

        for key, held in self._held.items():
            for (adapter, wanted), count in held.items():
                if wanted:
                    entry(key, adapter).uses.append(demand_pb2.AdapterUse(endpoint=wanted, queued=count))
                else:
                    entry(key, adapter).queued += count
        for key, use in self._use.items():
            for (adapter, endpoint), (in_flight, routed) in use.items():
                demand = entry(key, adapter)
                use_entry = next((u for u in demand.uses if u.endpoint == endpoint), None)
                if use_entry is None:
                    use_entry = demand.uses.add(endpoint=endpoint)
                use_entry.in_flight = in_flight
                use_entry.routed = routed
        return {key: list(by_adapter.values()) for key, by_adapter in out.items()}


class _Holding:
    __slots__ = ("_adapter", "_book", "_key", "_wanted")

    def __init__(self, book: AdapterBook, key: str, adapter: str, wanted: str) -> None:
        self._book, self._key, self._adapter, self._wanted = book, key, adapter, wanted

    def __enter__(self) -> _Holding:
        self._book._hold(self._key, self._adapter, self._wanted)
        return self

    def __exit__(self, *_: object) -> None:
        self._book._unhold(self._key, self._adapter, self._wanted)

    def move(self, wanted: str) -> None:
        """The request now waits for the adapter on `wanted` instead."""
        self._book._hold(self._key, self._adapter, wanted)
        self._book._unhold(self._key, self._adapter, self._wanted)
        self._wanted = wanted
