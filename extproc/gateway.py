"""What one extproc knows of its gateway (`Gateway`): its settings, the routes the feeder sent,
the keys, what it holds and routes now; shared by every ext_proc stream.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from wakegate.extproc.adapters import AdapterBook
from wakegate.extproc.auth import ApiKeys, Scope
from wakegate.extproc.budget import TokenBudgets
from wakegate.extproc.cold import ColdQueues
from wakegate.extproc.completions import Completions
from wakegate.extproc.flow import FlowControl
from wakegate.extproc.metrics import Metrics
from wakegate.extproc.naming import (
    RouteTable,
)
from wakegate.extproc.picking import Picker
from wakegate.extproc.ratelimit import RateLimiter
from wakegate.process import ThrottledLog
from wakegate.v1 import routing_pb2

log = logging.getLogger("wakegate.extproc")


@dataclass
class Settings:
    """How this extproc decides; one object per process."""

    #: Largest body buffered to find `model` (the listener enforces the same bound).
    max_body_bytes: int = 8 * 1024 * 1024
    #: Token bucket over all models, requests/s (0 = unlimited) and burst.
    global_rate: float = 0.0
    global_burst: float = 0.0
    #: Retry-After sent with cold-mode `reject` and failed activations, seconds.
    cold_retry_after: int = 5
    #: `GET /metrics` on the public listener: `off` (404), `open`, or `keys` (any valid API key).
    public_metrics: str = "off"
    #: Flow control: a request whose key names no tenant is fair-shared as the tenant its
    #: `x-gateway-inference-fairness-id` header names (False: as the default tenant).
    fairness_header: bool = False
    #: Retry-After of flow control's 429 `over_share`, seconds.
    flow_retry_after: int = 1


class Gateway:
    """State shared by every stream of one extproc process."""

    def __init__(self, settings: Settings, keys: ApiKeys, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.keys = keys
        self.metrics = metrics or Metrics()
        self.table = RouteTable()
        self.limiter = RateLimiter(settings.global_rate or None, settings.global_burst or None)
        self.picker = Picker()
        #: Admission of models with flow control (per-(tenant, band) queues while saturated).
        self.flow = FlowControl(self.picker.engines, self.picker.inflight.count, on_change=self._queued_change)
        #: Models with flow control (checked per request, kept per route change).
        self.flow_keys: set[str] = set()
        #: Tokens per tenant over the last minute, for tenants with a budget.
        self.budgets = TokenBudgets()
        self.in_flight: dict[str, int] = {}
        #: Requests its Envoy routes alone now, per model (extproc/native.py; empty without it):
        #: part of what the status and queue views say is in flight, never of extproc's own book.
        self.native_in_flight: dict[str, int] = {}
        self.on_demand_change: Callable[[], None] = lambda: None
        #: Load changes that may be reported a little later (coalesced).
        self.on_load_change: Callable[[], None] = lambda: None
        self.cold = ColdQueues(self._demand_changed, on_failure=self.flow.fail_waking)
        #: LoRA adapters loaded on demand: requests held for one, and use per endpoint.
        self.adapters = AdapterBook(self._demand_changed)
        #: One line per refused request (no traceback), a few per second per error code at most.
        self.refusals = ThrottledLog(log)
        #: Where routed requests are released when Envoy logs their end; None: when their
        #: ext_proc stream ends (the stream then stays open for the request's whole life).
        self.completions: Completions | None = None
        #: The first route table arrived: before it, every model is "not known yet", not "unknown".
        self.synced = False
        self._models_body = b'{"object":"list","data":[]}'
        #: `/v1/models` bodies of scoped keys, per scope, for the current routes.
        self._scoped_bodies: dict[Scope, bytes] = {}

    def _demand_changed(self) -> None:
        self.on_demand_change()

    def _queued_change(self, model: str, tenant: str, band: str, delta: int) -> None:
        self.metrics.flow_queued.labels(model, tenant, band).inc(delta)
        self.on_load_change()  # held requests are demand: the scaler may add a replica

    def held(self) -> dict[str, tuple[int, int, int]]:
        """key -> (held, live leases, failures seen): the cold queues' snapshot plus what flow
        control holds for saturated models (demand reports, the queue and status views)."""
        out = self.cold.snapshot()
        for key, depth in self.flow.depths().items():
            queued, leases, failures = out.get(key, (0, 0, 0))
            out[key] = (queued + depth, leases, failures)
        return out

    def used_tokens(self, tenant: str, tokens: int) -> None:
        """A budgeted request's usage (from an access-log entry, or a stream cut short here)."""
        self.budgets.add(tenant, tokens)
        self.metrics.tenant_tokens.labels(self.flow.label(tenant)).inc(tokens)

    def set_routes(self, routes: list[routing_pb2.ModelRoute]) -> None:
        """Take a whole route set: every route there is."""
        keys = {route.key for route in routes}
        self.update_routes(routes, [key for key in self.table.routes if key not in keys])

    def update_routes(self, changed: list[routing_pb2.ModelRoute], removed: list[str]) -> None:
        """Take what changed in the route set: routes new or changed, and the keys of those gone.

        The work is proportional to the change: a replica becoming ready touches its own route's
        names and queue, not every model's; `/v1/models` is rebuilt only when a name changed.
        """
        first = not self.synced
        self.synced = True
        self.table = RouteTable(changed) if first else self.table.updated(changed, removed)
        self.picker.update(changed, removed)
        for key in removed:
            self.picker.forget(key)
        if first or self.table.names_changed:
            self._models_body = json.dumps({"object": "list", "data": self.table.listing()}).encode()
            self._scoped_bodies = {}
        self.metrics.routes.set(len(self.table.routes))
        for route in changed:
            self.metrics.queue_limit.labels(route.key).set(route.cold.max_queue)
        for key in removed:
            with contextlib.suppress(KeyError):
                self.metrics.queue_limit.remove(key)
        self.metrics.route_updates.inc()
        self.cold.on_routes(self.table.routes)
        self.adapters.on_routes(self.table.routes)
        self.flow.on_routes(changed, removed)
        for route in changed:
            if route.flow.enabled:
                self.flow_keys.add(route.key)
            else:
                self.flow_keys.discard(route.key)
        self.flow_keys.difference_update(removed)

    def demand_delivered(self) -> None:
        """A demand report reached the scaler: time the activation signal of new leases."""
        for key, seconds in self.cold.delivered():
            self.metrics.cold_start.labels(key, "activation_signal").observe(seconds)

    @property
    def models_body(self) -> bytes:
        return self._models_body

    def models_body_for(self, scope: Scope) -> bytes:
        """`/v1/models` as a key with this scope sees it: only the models it may use."""
        if scope.models is None:
            return self._models_body
        body = self._scoped_bodies.get(scope)
        if body is None:
            if len(self._scoped_bodies) >= 256:  # scopes of keys since rotated away
                self._scoped_bodies.clear()
            listing = self.table.listing(lambda route: in_scope(scope, route))
            body = self._scoped_bodies[scope] = json.dumps({"object": "list", "data": listing}).encode()
        return body

    def queue_view(self) -> dict[str, Any]:
        """The `/wakegate/queue` JSON view: demand as this gateway sees it."""
        cold = self.held()
        busy = {k for k, v in self.in_flight.items() if v} | set(self.native_in_flight)
        keys = sorted(set(cold) | busy | set(self.table.routes))
        return {
            "models": [
                {
                    "model": key,
                    "queued": cold.get(key, (0, 0, 0))[0],
                    "leases": cold.get(key, (0, 0, 0))[1],
                    "in_flight": self.in_flight.get(key, 0) + self.native_in_flight.get(key, 0),
                    "ready_endpoints": len(self.table.routes[key].endpoints) if key in self.table.routes else 0,
                }
                for key in keys
            ]
        }

    def status_body_for(self, scope: Scope) -> bytes:
        """`GET /wakegate/status` as a key with this scope sees it: per model its names, whether
        it has ready endpoints, and what this gateway holds and routes for it (a federation's
        global gateway reads it to pick a member)."""
        cold = self.held()
        models = [
            {
                "model": route.names[0] if route.names else key,
                "names": list(route.names),
                "ready_endpoints": len(route.endpoints),
                "queued": cold.get(key, (0, 0, 0))[0],
                "in_flight": self.in_flight.get(key, 0) + self.native_in_flight.get(key, 0),
                "max_queue": route.cold.max_queue,
            }
            for key, route in sorted(self.table.routes.items())
            if in_scope(scope, route)
        ]
        return json.dumps({"synced": self.synced, "models": models}).encode()

    def routed(self, key: str, endpoint: str | None, adapter: str | None = None) -> None:
        count = self.in_flight[key] = self.in_flight.get(key, 0) + 1
        if adapter is not None and endpoint is not None:
            # Every use of an on-demand adapter reaches `up` soon (coalesced): it must not be unloaded now.
            self.adapters.started(key, adapter, endpoint)
            self.on_load_change()
        elif count == 1:
            self.on_load_change()  # a model going from idle to busy: the scaler's idle timer
        self.metrics.in_flight.labels(key).inc()
        self.metrics.requests.labels(key, "routed", "").inc()
        if endpoint is not None:
            self.picker.inflight.acquire(endpoint)

    def finished(self, key: str, endpoint: str | None, adapter: str | None = None) -> None:
        self.in_flight[key] -= 1
        if adapter is not None and endpoint is not None:
            self.adapters.ended(key, adapter, endpoint)
            self.on_load_change()
        if not self.in_flight[key]:
            del self.in_flight[key]
            self.on_load_change()
        self.metrics.in_flight.labels(key).dec()
        if endpoint is not None:
            self.picker.inflight.release(endpoint)
        self.flow.kick(key)  # room for a request held by flow control


def in_scope(scope: Scope, route: routing_pb2.ModelRoute) -> bool:
    """Whether a key with this scope may use the model of `route` (by its key or its own name)."""
    return scope.allows(route.key, route.names[0] if route.names else route.key)
