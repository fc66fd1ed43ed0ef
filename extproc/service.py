"""The ext_proc stream handler: one bidirectional stream per HTTP request.

Order of decisions for each request, cheapest first, nothing queued before auth:
open paths (/healthz; /metrics as --public-metrics says) -> auth (the key's
scope) -> model from header or path (else ask Envoy for the buffered body) ->
resolve name -> in the key's scope? -> rate limit -> ready endpoint?
-> pick + mutations (cluster header, endpoint header + envoy.lb metadata, body
rewrite). A model with no ready endpoint takes the cold path: demand first,
then its cold mode (hold here, keepalive via the activator, or reject). A request
for a LoRA adapter loaded on demand goes to an endpoint that holds it, or is held
until `up` has loaded it (extproc/adapters.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import duration_pb2, struct_pb2
from google.protobuf.message import DecodeError
from prometheus_client import generate_latest

from wakegate.contract import (
    ACTIVATOR_CLUSTER,
    ACTIVATOR_MODEL_HEADER,
    ADAPTER_UNAVAILABLE,
    BANDS,
    CLUSTER_HEADER,
    DESTINATION_HEADER,
    FAIRNESS_HEADER,
    LB_METADATA_NAMESPACE,
    PRIORITY_HEADER,
    RATE_COUNTED_HEADER,
    STATUS_PATH,
    STRATEGY_NAMES,
    UNSERVED_HEADER,
)
from wakegate.extproc.adapters import AdapterBook, AdapterFailed, Placement, adapter_route, placement
from wakegate.extproc.auth import ALL_MODELS, ApiKeys, Scope
from wakegate.extproc.budget import USAGE_NAMESPACE, TokenBudgets, Usage
from wakegate.extproc.cold import ActivationFailed, ActivationTimeout, ColdQueues, QueueFull
from wakegate.extproc.completions import REQUEST_ID_HEADER, Completions
from wakegate.extproc.flow import BAND_RANK, DEFAULT_TENANT, FlowControl, Shed, Ticket
from wakegate.extproc.h2grpc.call import INTERNAL, INVALID_ARGUMENT, Call
from wakegate.extproc.metrics import Metrics
from wakegate.extproc.naming import (
    BadRequest,
    Resolved,
    RouteTable,
    model_from_headers,
    model_from_json,
    model_from_multipart,
    parse_json_body,
)
from wakegate.extproc.picking import Picker
from wakegate.extproc.ratelimit import RateLimiter, retry_after_header
from wakegate.extproc.responses import error, error_body, header, immediate
from wakegate.process import ThrottledLog
from wakegate.v1 import routing_pb2

log = logging.getLogger("wakegate.extproc")

_BUFFER_BODY = ep.ProcessingResponse(
    request_headers=ep.HeadersResponse(),
    mode_override=processing_mode_pb2.ProcessingMode(request_body_mode=processing_mode_pb2.ProcessingMode.BUFFERED),
)
#: The same for a tenant with a token budget: its response body streams past extproc, which reads
#: the engine's usage at its end (extproc/budget.py).
_BUFFER_BODY_COUNTED = ep.ProcessingResponse(
    request_headers=ep.HeadersResponse(),
    mode_override=processing_mode_pb2.ProcessingMode(
        request_body_mode=processing_mode_pb2.ProcessingMode.BUFFERED,
        response_body_mode=processing_mode_pb2.ProcessingMode.STREAMED,
    ),
)
_CONTINUE_BODY = ep.ProcessingResponse(request_body=ep.BodyResponse())
#: A request routed from its headers does not need its body buffered. The gateway's routes
#: already say so for X-Model-ID and /model/<name>/ requests; this covers any other Envoy setup.
_NO_BODY = processing_mode_pb2.ProcessingMode(request_body_mode=processing_mode_pb2.ProcessingMode.NONE)
_NO_BODY_COUNTED = processing_mode_pb2.ProcessingMode(
    request_body_mode=processing_mode_pb2.ProcessingMode.NONE,
    response_body_mode=processing_mode_pb2.ProcessingMode.STREAMED,
)


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


PUBLIC_METRICS = ("off", "open", "keys")


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


def _headers(message: ep.HttpHeaders) -> dict[str, str]:
    return {
        h.key: (h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value) for h in message.headers.headers
    }


class _Exchange:
    """Per-request state between the headers and body phases."""

    __slots__ = (
        "adapter",
        "band",
        "endpoint",
        "headers",
        "headers_only",
        "model_key",
        "model_name",
        "new_body",
        "new_path",
        "scope",
        "started",
        "tenant",
        "usage",
        "wants_body",
    )

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.model_name: str | None = None
        self.new_path: str | None = None
        #: The request has no body (its headers ended the stream).
        self.headers_only = False
        #: A LoRAAdapter named in the headers: the body is read to tell the engine which one.
        self.wants_body: str | None = None
        #: The body re-encoded with the name its backend knows (None: forwarded unchanged).
        self.new_body: bytes | None = None
        self.endpoint: str | None = None
        #: The on-demand LoRA adapter the request was routed with (its use is counted per endpoint).
        self.adapter: str | None = None
        self.model_key: str | None = None
        #: The models the request's API key may use.
        self.scope: Scope = ALL_MODELS
        self.started = time.monotonic()
        #: Flow control: who the request is fair-shared as, and its band's rank (0 highest).
        self.tenant = ""
        self.band = 0
        #: A tenant with a token budget: what its response says it used, read as it streams past.
        self.usage: Usage | None = None


@dataclass(slots=True)
class _Cold:
    """The request must wait for its model: what to resume with once it is ready."""

    resolved: Resolved
    parsed: dict[str, Any] | None
    raw_body: bytes | None
    in_body: bool
    #: The model is ready but no endpoint holds the request's adapter: wait for a load (on this
    #: endpoint, for random placement; anywhere when empty).
    for_adapter: bool = False
    wanted: str = ""
    #: The model is saturated: the request waits in flow control's queues.
    ticket: Ticket | None = None

    def timeout_s(self) -> float:
        """How long the request may wait (the cold activation timeout, or the flow queue's)."""
        route = self.resolved.route
        if self.ticket is not None and not self.ticket.cold:
            return route.flow.queue_timeout_ms / 1000
        return route.cold.activation_timeout_ms / 1000

    def longest_s(self) -> float:
        """How long it may wait at most: a cold request of a flow-controlled model may wait for its
        turn once the model is ready."""
        flow = self.resolved.route.flow
        turn = flow.enabled and (self.ticket is None or self.ticket.cold)
        return self.timeout_s() + (flow.queue_timeout_ms / 1000 if turn else 0)


EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
PROCESS_METHOD = f"/{EXT_PROC_SERVICE}/Process"


#: What a request still held when extproc stops gets: the gateway's retriable 503, marked as having
#: reached no model server (the same words as Envoy's own reply when no extproc answers).
_STOPPING = immediate(
    503,
    error_body(503, "gateway_unavailable", "the gateway is starting or restarting a component; retry shortly"),
    extra_headers=[("retry-after", "1"), (UNSERVED_HEADER, "1")],
    details="wakegate_gateway_unavailable",
)


class Processor:
    """Decides each ext_proc message; `call()` serves one ext_proc stream (one HTTP request)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        #: The streams whose request is held for its model now.
        self.holding: set[ProcessCall] = set()

    def let_go(self) -> int:
        """Stopping: answer every held request now (the retriable 503), rather than cut its stream
        with the connection, which would have Envoy replay it to an extproc that is stopping too
        (or to none, while the gateway goes away). Returns how many there were."""
        calls = list(self.holding)
        for call in calls:
            call.let_go()
        return len(calls)

    def call(self, call: Call) -> ProcessCall:
        return ProcessCall(self, call)

    def decide(self, exchange: _Exchange, message: ep.ProcessingRequest) -> ep.ProcessingResponse | _Cold:
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            exchange.started = time.monotonic()
            return self._on_headers(exchange, message.request_headers)
        if kind == "request_body":
            return self._on_body(exchange, message.request_body)
        if kind == "response_headers":
            return ep.ProcessingResponse(response_headers=ep.HeadersResponse())
        if kind == "response_body":
            return self._on_response_body(exchange, message.response_body)
        if kind == "request_trailers":
            return ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
        return ep.ProcessingResponse(response_trailers=ep.TrailersResponse())

    # -- phases ---------------------------------------------------------------------------------

    def _on_response_body(self, ex: _Exchange, message: ep.HttpBody) -> ep.ProcessingResponse:
        """A budgeted request's response streams past: its last chunk says what it used, which goes
        to Envoy's access log (and from there to every extproc's book) as dynamic metadata."""
        usage = ex.usage
        if usage is None:
            return ep.ProcessingResponse(response_body=ep.BodyResponse())
        usage.feed(message.body)
        if not message.end_of_stream:
            return ep.ProcessingResponse(response_body=ep.BodyResponse())
        ex.usage = None
        metadata = struct_pb2.Struct()
        used = metadata.get_or_create_struct(USAGE_NAMESPACE)
        used["tenant"] = usage.tenant
        used["tokens"] = usage.tokens()
        if self.gw.completions is None:  # no access log to learn it from
            self.gw.used_tokens(usage.tenant, usage.tokens())
        return ep.ProcessingResponse(response_body=ep.BodyResponse(), dynamic_metadata=metadata)

    def _on_headers(self, ex: _Exchange, message: ep.HttpHeaders) -> ep.ProcessingResponse | _Cold:
        headers = _headers(message)
        ex.headers = headers
        path = headers.get(":path", "")
        get = headers.get(":method") == "GET"
        public_metrics = self.gw.settings.public_metrics
        if get and path == "/healthz":
            return immediate(200, b'{"status":"ok"}')
        if get and path == "/metrics" and public_metrics != "keys":
            if public_metrics == "open":
                return self._metrics()
            return self._reject(None, 404, "not_found", "/metrics is not served here; scrape the admin port")
        scope = self.gw.keys.scope(headers.get("authorization"))
        if scope is None:
            return self._reject(None, 401, "invalid_api_key", "missing or invalid API key")
        ex.scope = scope
        if get:
            if path == "/metrics":
                return self._metrics()
            if path == STATUS_PATH:
                return self._done(None, immediate(200, self.gw.status_body_for(scope)))
            listed = self._models_api(path.split("?", 1)[0], scope)
            if listed is not None:
                return listed
        try:
            found = model_from_headers(headers)
        except BadRequest as exc:
            return self._reject(None, 400, exc.code, str(exc))
        ex.new_path = found.new_path
        if found.model is not None:
            ex.model_name = found.model
            ex.headers_only = message.end_of_stream
            return self._decide(ex, None, None, in_body=False)
        # The model is in the body: check what we can before asking Envoy to buffer it.
        if message.end_of_stream:
            return self._reject(
                None,
                400,
                "model_required",
                "no model named: send X-Model-ID, /model/<name>/..., or a body with `model`",
            )
        content_type = headers.get("content-type", "").lower()
        if not (content_type.startswith("application/json") or content_type.startswith("multipart/form-data")):
            return self._reject(
                None,
                415,
                "unsupported_media_type",
                "body must be application/json or multipart/form-data to name a model",
            )
        length = headers.get("content-length")
        if length is not None:
            try:
                too_big = int(length) > self.gw.settings.max_body_bytes
            except ValueError:
                return self._reject(None, 400, "invalid_content_length", "content-length is not a number")
            if too_big:
                return self._reject(
                    None, 413, "body_too_large", f"request body exceeds {self.gw.settings.max_body_bytes} bytes"
                )
        return _BUFFER_BODY_COUNTED if scope.tokens_per_minute else _BUFFER_BODY

    def _on_body(self, ex: _Exchange, message: ep.HttpBody) -> ep.ProcessingResponse | _Cold:
        if ex.model_name is not None:
            return _CONTINUE_BODY  # routed from headers; Envoy should not have sent it
        body = message.body
        if len(body) > self.gw.settings.max_body_bytes:
            return self._reject(
                None, 413, "body_too_large", f"request body exceeds {self.gw.settings.max_body_bytes} bytes"
            )
        content_type = ex.headers.get("content-type", "")
        try:
            if content_type.lower().startswith("multipart/form-data"):
                ex.model_name = ex.wants_body or model_from_multipart(content_type, body)
                return self._decide(ex, None, None, in_body=True)
            parsed = parse_json_body(body)
            ex.model_name = ex.wants_body or model_from_json(parsed)
        except BadRequest as exc:
            return self._reject(None, 400, exc.code, str(exc))
        return self._decide(ex, parsed, body, in_body=True)

    def _models_api(self, path: str, scope: Scope) -> ep.ProcessingResponse | None:
        """OpenAI's model list and model retrieval, answered from the route table; None for other paths.

        A scoped key sees only its models: the others are "not found", as if they did not exist.
        """
        if path in ("/v1/models", "/models"):
            return self._done(None, immediate(200, self.gw.models_body_for(scope)))
        prefix = "/v1/models/" if path.startswith("/v1/models/") else "/models/" if path.startswith("/models/") else ""
        if not prefix:
            return None
        name = unquote(path[len(prefix) :])
        resolved = self.gw.table.resolve(name)
        found = self.gw.table.model_object(name) if resolved is not None and in_scope(scope, resolved.route) else None
        if found is None:
            return self._reject(None, 404, "model_not_found", f"model {name!r} does not exist")
        return self._done(None, immediate(200, json.dumps(found).encode()))

    # -- decisions ------------------------------------------------------------------------------

    def _decide(
        self, ex: _Exchange, parsed: dict[str, Any] | None, raw_body: bytes | None, *, in_body: bool
    ) -> ep.ProcessingResponse | _Cold:
        assert ex.model_name is not None
        resolved = self.gw.table.resolve(ex.model_name)
        if resolved is None:
            if not self.gw.synced:
                return self._reject(
                    None, 503, "gateway_starting", "the gateway is starting; retry shortly", retry_after="1"
                )
            return self._reject(None, 404, "model_not_found", f"model {ex.model_name!r} does not exist")
        route = resolved.route
        if not in_scope(ex.scope, route):
            # The same answer as for a model that does not exist: a key learns nothing about models
            # outside its scope, and nothing else happens (no rate-limit token, no demand).
            return self._reject(None, 404, "model_not_found", f"model {ex.model_name!r} does not exist")
        scope = ex.scope
        if scope.tokens_per_minute:
            tenant = scope.tenant or DEFAULT_TENANT
            wait = self.gw.budgets.retry_after(tenant, scope.tokens_per_minute)
            if wait > 0:
                label = self.gw.flow.label(tenant)
                self.gw.metrics.flow_shed.labels(route.key, label, scope.band, "token_budget").inc()
                return self._reject(
                    route.key, 429, "token_budget", f"tenant used its {scope.tokens_per_minute} tokens per minute; "
                    "retry later", retry_after=retry_after_header(wait)
                )
        if parsed is None and resolved.needs_body and not in_body and not ex.headers_only:
            # An adapter named in the headers: the engine is told which one in the body.
            ex.wants_body = ex.model_name
            ex.model_name = None
            return _BUFFER_BODY
        flow = route.key in self.gw.flow_keys  # a set lookup: a proto submessage costs ~0.4 µs
        if flow:
            refused = self._identify(ex, route)
            if refused is not None:
                return refused
        rate = route.rate_limit
        # Envoy's bucket took the token of a request it counted (it said so, for this model).
        counted = rate.counted_by_envoy and ex.headers.get(RATE_COUNTED_HEADER) == route.key
        wait = self.gw.limiter.admit(
            route.key,
            rate.requests_per_second or None,
            rate.burst or None,
            counted_elsewhere=counted,
            global_counted_elsewhere=counted and rate.global_counted_by_envoy,
        )
        if wait > 0:
            return self._reject(
                route.key, 429, "rate_limited", "rate limit exceeded; retry later", retry_after=retry_after_header(wait)
            )
        if parsed is not None and resolved.needs_rewrite(parsed):
            # Rewritten now, not when the request is sent on: a body that cannot be is refused
            # before it waits for a cold model.
            try:
                ex.new_body = resolved.rewrite(parsed)
            except BadRequest as exc:
                return self._reject(route.key, 400, exc.code, str(exc))
        lora = adapter_route(route, resolved.adapter)
        if route.endpoints:
            if flow:
                held = self._flow_admit(ex, resolved, parsed, raw_body, in_body)
                if held is not None:
                    return held
            if lora is None:
                return self._forward(ex, resolved, parsed, raw_body, in_body=in_body)
            place = placement(route, lora, self.gw.adapters.draw)
            if place.endpoints:
                self.gw.metrics.adapter_requests.labels(route.key, "direct").inc()
                return self._forward(ex, resolved, parsed, raw_body, in_body=in_body, place=place)
            # No endpoint holds the adapter: held (whatever the cold mode) while `up` loads it.
            return _Cold(resolved, parsed, raw_body, in_body, for_adapter=True, wanted=place.wanted)
        # Cold: demand is registered before anything that can wait or refuse.
        self.gw.cold.demand(route)
        mode = route.cold.mode
        if mode == routing_pb2.COLD_MODE_REJECT:
            return self._retry_later(route, 503, "model_not_ready", f"model {ex.model_name!r} is starting; retry later")
        if (
            mode == routing_pb2.COLD_MODE_KEEPALIVE
            and lora is None  # the activator forwards without waiting for an adapter's load
            and parsed is not None
            and parsed.get("stream") is True
        ):
            if self.gw.cold.depth(route.key) >= route.cold.max_queue:
                return self._queue_full(route)
            return self._to_activator(ex, resolved, parsed, raw_body, in_body=in_body)
        if flow and lora is None:  # held by flow control's rules while the model wakes, too
            return self._flow_admit(ex, resolved, parsed, raw_body, in_body) or _Cold(
                resolved, parsed, raw_body, in_body
            )
        return _Cold(resolved, parsed, raw_body, in_body)

    def _flow_admit(
        self, ex: _Exchange, resolved: Resolved, parsed: dict[str, Any] | None, raw_body: bytes | None, in_body: bool
    ) -> ep.ProcessingResponse | _Cold | None:
        """Flow control's admission: None (the request goes on now), held (for its turn), or refused."""
        route = resolved.route
        try:
            ticket = self.gw.flow.admit(route, ex.tenant, ex.band, ex.scope.weight)
        except Shed as exc:
            return self._shed(route, exc, ex)
        return None if ticket is None else _Cold(resolved, parsed, raw_body, in_body, ticket=ticket)

    def _identify(self, ex: _Exchange, route: routing_pb2.ModelRoute) -> ep.ProcessingResponse | None:
        """Who a request of a flow-controlled model is fair-shared as, and its band; a refusal when
        its headers ask for something unknown."""
        tenant = ex.scope.tenant
        if not tenant and self.gw.settings.fairness_header:
            tenant = ex.headers.get(FAIRNESS_HEADER, "")
            if len(tenant) > 128 or not tenant.isprintable():
                return self._reject(route.key, 400, "invalid_fairness_id", f"{FAIRNESS_HEADER} is over 128 characters "
                                    "or not printable")
        ex.tenant = tenant or DEFAULT_TENANT
        band = BAND_RANK.get(ex.scope.band or route.flow.band, 1)
        asked = ex.headers.get(PRIORITY_HEADER)
        if asked is not None:
            rank = BAND_RANK.get(asked.strip().lower())
            if rank is None:
                return self._reject(route.key, 400, "invalid_priority",
                                    f"{PRIORITY_HEADER} must be one of {', '.join(BANDS)}")
            band = max(band, rank)  # a request may only lower its band
        ex.band = band
        return None

    def _shed(self, route: routing_pb2.ModelRoute, exc: Shed, ex: _Exchange) -> ep.ProcessingResponse:
        """Flow control's refusal: 429 over the tenant's share, 503 when the model cannot take it."""
        self.gw.metrics.flow_shed.labels(route.key, self.gw.flow.label(ex.tenant), BANDS[ex.band], exc.code).inc()
        retry = self.gw.settings.flow_retry_after if exc.status == 429 else self.gw.settings.cold_retry_after
        return self._reject(route.key, exc.status, exc.code, str(exc), retry_after=str(retry))

    async def _admitted(self, ex: _Exchange, cold: _Cold, deadline: float) -> ep.ProcessingResponse:
        """A request held by flow control: once dispatched, routed as usual."""
        route = cold.resolved.route
        assert cold.ticket is not None
        if cold.ticket.cold:
            self.gw.metrics.queue_depth.labels(route.key).inc()
        try:
            waited = await self.gw.flow.wait(route, cold.ticket, deadline)
        except Shed as exc:
            return self._shed(route, exc, ex)
        except ActivationFailed as exc:
            return self._retry_later(route, 503, exc.code, exc.answer(ex.model_name or route.key))
        finally:
            if cold.ticket.cold:
                self.gw.metrics.queue_depth.labels(route.key).dec()
        if cold.ticket.cold:
            woke = self.gw.cold.flushed(route.key)
            if woke is not None:
                self.gw.metrics.cold_start.labels(route.key, "first_byte").observe(woke)
        self.gw.metrics.flow_wait.labels(route.key, BANDS[ex.band]).observe(waited)
        self.gw.metrics.flow_dispatched.labels(route.key, self.gw.flow.label(ex.tenant), BANDS[ex.band]).inc()
        resolved = self.gw.table.resolve(ex.model_name or "")
        if resolved is None or not in_scope(ex.scope, resolved.route):
            return self._reject(None, 404, "model_not_found", f"model {ex.model_name!r} does not exist")
        held = _Cold(resolved, cold.parsed, cold.raw_body, cold.in_body)
        if not resolved.route.endpoints or adapter_route(resolved.route, resolved.adapter) is not None:
            # Cold again, or an adapter to place: the usual path, from the top.
            return await self.hold(ex, held, time.monotonic() + held.timeout_s())
        return self._forward(ex, resolved, cold.parsed, cold.raw_body, in_body=cold.in_body)

    async def hold(self, ex: _Exchange, cold: _Cold, deadline: float) -> ep.ProcessingResponse:
        if cold.ticket is not None:
            return await self._admitted(ex, cold, deadline)
        route = cold.resolved.route
        lora = adapter_route(route, cold.resolved.adapter)
        place: Placement | None = None
        self.gw.metrics.queue_depth.labels(route.key).inc()
        try:
            if cold.for_adapter and lora is not None:
                place = await self.gw.adapters.wait(
                    route.key, lora.served_name, cold.wanted, deadline, route.cold.max_queue,
                    self.gw.cold.depth(route.key),
                )
            else:
                # A request for an adapter of a cold base is its demand too: `up` loads it before
                # the woken replica is routed.
                wanting = self.gw.adapters.holding(route.key, lora.served_name) if lora is not None else None
                with wanting or contextlib.nullcontext():
                    await self.gw.cold.wait(route, deadline)
        except QueueFull:
            return self._queue_full(route)
        except ActivationTimeout:
            what = f"adapter {ex.model_name!r} was not loaded" if cold.for_adapter else (
                f"model {ex.model_name!r} did not become ready"
            )
            return self._reject(
                route.key, 503, "activation_timeout", f"{what} within {route.cold.activation_timeout_ms // 1000}s"
            )
        except ActivationFailed as exc:
            return self._retry_later(route, 503, exc.code, exc.answer(ex.model_name or route.key))
        except AdapterFailed as exc:
            message = f"adapter {ex.model_name!r} cannot be loaded: {exc}"
            return self._retry_later(route, 503, ADAPTER_UNAVAILABLE, message)
        finally:
            self.gw.metrics.queue_depth.labels(route.key).dec()
        resolved = self.gw.table.resolve(ex.model_name or "")
        if resolved is None or not in_scope(ex.scope, resolved.route):
            return self._reject(None, 404, "model_not_found", f"model {ex.model_name!r} does not exist")
        if not resolved.route.endpoints:  # ready and gone again within one push: hold once more
            return await self.hold(ex, _Cold(resolved, cold.parsed, cold.raw_body, cold.in_body), deadline)
        if not cold.for_adapter:
            waited = self.gw.cold.flushed(resolved.route.key)
            if waited is not None:
                self.gw.metrics.cold_start.labels(resolved.route.key, "first_byte").observe(waited)
        lora = adapter_route(resolved.route, resolved.adapter)
        if lora is not None and place is None:
            place = placement(resolved.route, lora, self.gw.adapters.draw)
            if not place.endpoints:  # woken without it: wait for its load
                held = _Cold(resolved, cold.parsed, cold.raw_body, cold.in_body, for_adapter=True, wanted=place.wanted)
                return await self.hold(ex, held, deadline)
        if place is not None:
            self.gw.metrics.adapter_requests.labels(resolved.route.key, "waited").inc()
        elif resolved.route.flow.enabled:
            # Woken with the rest of the cold queue: admitted like any other request, so the
            # flood that waited for the model is dispatched by band and tenant, not all at once.
            if not ex.tenant:
                refused = self._identify(ex, resolved.route)
                if refused is not None:
                    return refused
            admitted = self._flow_admit(ex, resolved, cold.parsed, cold.raw_body, cold.in_body)
            if isinstance(admitted, _Cold):
                return await self._admitted(ex, admitted, time.monotonic() + admitted.timeout_s())
            if admitted is not None:
                return admitted
        return self._forward(ex, resolved, cold.parsed, cold.raw_body, in_body=cold.in_body, place=place)

    def _queue_full(self, route: routing_pb2.ModelRoute) -> ep.ProcessingResponse:
        return self._retry_later(route, 429, "queue_full", f"too many requests waiting for model {route.key!r}")

    def _retry_later(
        self, route: routing_pb2.ModelRoute, status: int, code: str, message: str
    ) -> ep.ProcessingResponse:
        """A cold-path refusal: the client should come back after the cold Retry-After."""
        return self._reject(route.key, status, code, message, retry_after=str(self.gw.settings.cold_retry_after))

    def _mutations(
        self,
        ex: _Exchange,
        resolved: Resolved,
        parsed: dict[str, Any] | None,
        raw_body: bytes | None,
        cluster: str,
        extra: list[Any],
    ) -> ep.CommonResponse:
        mutations = [header(CLUSTER_HEADER, cluster), *extra]
        removals: list[str] = []
        if self.gw.keys.enabled:
            removals.append("authorization")  # the gateway's key is not the backend's business
        if DESTINATION_HEADER in ex.headers and not any(m.header.key == DESTINATION_HEADER for m in extra):
            removals.append(DESTINATION_HEADER)  # clients may not pick backends themselves
        if ex.new_path is not None:
            mutations.append(header(":path", ex.new_path))
        body_mutation = None
        if parsed is not None and raw_body is not None and resolved.needs_rewrite(parsed):
            # The routes changed while the request was held; it was encodable once, so it is now.
            ex.new_body = resolved.rewrite(parsed)
        if ex.new_body is not None:
            body_mutation = ep.BodyMutation(body=ex.new_body)
            mutations.append(header("content-length", str(len(ex.new_body))))
        common = ep.CommonResponse(
            header_mutation=ep.HeaderMutation(set_headers=mutations, remove_headers=removals),
            body_mutation=body_mutation,
            clear_route_cache=True,
        )
        return common

    def _forward(
        self,
        ex: _Exchange,
        resolved: Resolved,
        parsed: dict[str, Any] | None,
        raw_body: bytes | None,
        *,
        in_body: bool,
        place: Placement | None = None,
    ) -> ep.ProcessingResponse:
        """Route to one of the model's ready endpoints (with `place`: one of those that hold its
        on-demand adapter, which the picker then need not ask the engines about)."""
        route = resolved.route
        strategy = STRATEGY_NAMES.get(route.strategy, "default")
        endpoints = []
        loads: dict[str, int] = {}  # engines' own counts, for the strategies that may go least-loaded
        weights: dict[str, int] = {}  # shares among endpoints tied on load (federation members)
        for e in route.endpoints:
            key = f"{e.address}:{e.port}"
            if place is not None and key not in place.endpoints:
                continue
            endpoints.append(key)
            if e.engine_load:
                loads[key] = e.engine_load
            if e.weight:
                weights[key] = e.weight
        adapter = None if place is not None else resolved.adapter
        endpoint = self.gw.picker.pick(
            route.key, strategy, endpoints, ex.headers, parsed, loads, adapter, shares=weights or None
        )
        if endpoint is None and place is not None:
            endpoint = endpoints[0] if endpoints else None  # Envoy must not choose: only these hold it
        extra = []
        metadata: struct_pb2.Struct | None = None
        if endpoint is not None:
            destination = endpoint
            if route.fallback_endpoints:  # where Envoy retries a request no upstream saw
                others = [e for e in endpoints if e != endpoint][: route.fallback_endpoints]
                destination = ",".join([endpoint, *others])
            extra.append(header(DESTINATION_HEADER, destination))
            metadata = struct_pb2.Struct()
            metadata.get_or_create_struct(LB_METADATA_NAMESPACE)[DESTINATION_HEADER] = destination
        common = self._mutations(ex, resolved, parsed, raw_body, route.cluster, extra)
        ex.model_key = route.key
        ex.endpoint = endpoint
        ex.adapter = resolved.adapter if place is not None else None
        self.gw.routed(route.key, endpoint, ex.adapter)
        completions = self.gw.completions
        request_id = ex.headers.get(REQUEST_ID_HEADER, "")
        if completions is not None and completions.track(request_id, route.key, endpoint, ex.adapter):
            ex.model_key = None  # released by its access-log entry, not by this stream
        if ex.scope.tokens_per_minute:
            ex.usage = Usage(ex.scope.tenant or DEFAULT_TENANT)  # the stream stays open for the response
        self.gw.metrics.pick_seconds.observe(time.monotonic() - ex.started)
        if in_body:
            return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common), dynamic_metadata=metadata)
        return ep.ProcessingResponse(
            request_headers=ep.HeadersResponse(response=common),
            dynamic_metadata=metadata,
            mode_override=_NO_BODY_COUNTED if ex.usage is not None else _NO_BODY,
        )

    def _to_activator(
        self, ex: _Exchange, resolved: Resolved, parsed: dict[str, Any], raw_body: bytes | None, *, in_body: bool
    ) -> ep.ProcessingResponse:
        extra = [header(ACTIVATOR_MODEL_HEADER, resolved.route.key)]
        common = self._mutations(ex, resolved, parsed, raw_body, ACTIVATOR_CLUSTER, extra)
        self.gw.metrics.requests.labels(resolved.route.key, "200", "keepalive").inc()
        if in_body:
            return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common))
        return ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common), mode_override=_NO_BODY)

    def release(self, ex: _Exchange) -> None:
        """The request is over: release its in-flight count (once)."""
        usage, ex.usage = ex.usage, None
        if usage is not None:  # cut before its end: what it streamed so far
            self.gw.used_tokens(usage.tenant, usage.tokens())
        if ex.model_key is None:
            return
        self.gw.finished(ex.model_key, ex.endpoint, ex.adapter)
        ex.model_key = None

    def _metrics(self) -> ep.ProcessingResponse:
        return immediate(
            200, generate_latest(self.gw.metrics.registry), content_type="text/plain; version=0.0.4; charset=utf-8"
        )

    def _reject(
        self, model_key: str | None, status: int, code: str, message: str, *, retry_after: str | None = None
    ) -> ep.ProcessingResponse:
        self.gw.refusals.log(logging.INFO, code, "refused %d %s model=%s: %s", status, code, model_key or "-", message)
        return self._done(model_key, error(status, code, message, retry_after=retry_after), str(status), code)

    def failed(self, exc: Exception) -> ep.ProcessingResponse:
        """A request the gateway itself failed on (a bug, never the client's input): a shaped 500."""
        if self.gw.refusals.log(logging.ERROR, "internal_error", "request failed: %s", type(exc).__name__):
            log.debug("request failed", exc_info=exc)
        return self._done(
            None, error(500, "internal_error", "the gateway failed on this request"), "500", "internal_error"
        )

    def _done(
        self, model_key: str | None, response: ep.ProcessingResponse, status: str = "200", reason: str = ""
    ) -> ep.ProcessingResponse:
        self.gw.metrics.requests.labels(model_key or "", status, reason).inc()
        return response


class ProcessCall:
    """One ext_proc stream. Answers on the event loop thread; only a held request gets a task.

    Envoy sends one message per phase and waits for its answer, so at most one message is
    decided at a time; one arriving while a cold request is held waits behind it. The stream
    ends with Envoy's half-close (answered with status OK) or a reset; if a request is still
    held then, its client went away and it leaves the queue. Either way the request's
    in-flight count is released once.
    """

    __slots__ = ("_backlog", "_call", "_exchange", "_held", "_proc")

    def __init__(self, proc: Processor, call: Call) -> None:
        self._proc = proc
        self._call = call
        self._exchange = _Exchange()
        self._held: asyncio.Task[None] | None = None
        self._backlog: list[bytes] = []

    def on_message(self, data: bytes) -> None:
        if self._held is not None:
            self._backlog.append(data)
            return
        self._handle(data)

    def on_half_close(self) -> None:
        # Envoy half-closes when it is done with the request; if a message is still held,
        # nobody waits for its answer any more (the client went away): as for a reset.
        self.on_cancel()
        self._call.finish()

    def on_cancel(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.cancel()
        self._close()

    def let_go(self) -> None:
        """Answer the held request with the retriable 503 now (extproc is stopping)."""
        held, self._held = self._held, None
        if held is None:
            return
        held.cancel()
        self._close()
        self._proc._done(None, _STOPPING, "503", "gateway_unavailable")
        self._call.send(_STOPPING.SerializeToString())
        self._call.finish()

    def _answer(self, decided: ep.ProcessingResponse) -> None:
        """Send a decision; once the request needs nothing more from us, end the stream, so
        that Envoy carries the rest of the request without this process."""
        self._call.send(decided.SerializeToString())
        ex = self._exchange
        if (
            decided is not _BUFFER_BODY
            and decided is not _BUFFER_BODY_COUNTED
            and ex.model_key is None
            and ex.usage is None
            and self._proc.gw.completions is not None
        ):
            self._call.finish()

    def _handle(self, data: bytes) -> None:
        try:
            message = ep.ProcessingRequest.FromString(data)
        except DecodeError:
            self._close()
            self._call.finish(INVALID_ARGUMENT, "not an ext_proc ProcessingRequest")
            return
        try:
            decided = self._proc.decide(self._exchange, message)
        except Exception as exc:
            decided = self._proc.failed(exc)
        if isinstance(decided, _Cold):
            timeout_s = decided.timeout_s()
            # Tell Envoy this message may take up to the activation (or queue) timeout.
            self._call.send(
                ep.ProcessingResponse(
                    override_message_timeout=duration_pb2.Duration(seconds=int(decided.longest_s()) + 1)
                ).SerializeToString()
            )
            self._held = asyncio.get_running_loop().create_task(self._hold(decided, self._exchange.started + timeout_s))
            self._proc.holding.add(self)
            return
        self._answer(decided)

    async def _hold(self, cold: _Cold, deadline: float) -> None:
        try:
            decided = await self._proc.hold(self._exchange, cold, deadline)
        except asyncio.CancelledError:
            return  # on_cancel already released the request
        except Exception:
            log.exception("holding a cold request failed")
            self._held = None
            self._close()
            self._call.finish(INTERNAL, "internal error")
            return
        self._held = None
        self._proc.holding.discard(self)
        self._answer(decided)
        while self._backlog and self._held is None and not self._call.finished:
            self._handle(self._backlog.pop(0))

    def _close(self) -> None:
        self._proc.holding.discard(self)
        self._backlog.clear()
        self._proc.release(self._exchange)
