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

import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2
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
    PARK_CLUSTER,
    PARK_HEADER,
    PRIORITY_HEADER,
    RATE_COUNTED_HEADER,
    RELEASE_HEADER,
    STATUS_PATH,
    STRATEGY_NAMES,
)
from wakegate.extproc.adapters import AdapterFailed, Placement, adapter_route, placement
from wakegate.extproc.auth import Scope
from wakegate.extproc.budget import USAGE_NAMESPACE, Usage
from wakegate.extproc.cold import ActivationFailed, ActivationTimeout, QueueFull
from wakegate.extproc.completions import REQUEST_ID_HEADER
from wakegate.extproc.exchange import BUFFER_BODY, BUFFER_BODY_COUNTED, Cold, Exchange, headers_of
from wakegate.extproc.flow import BAND_RANK, DEFAULT_TENANT, Shed
from wakegate.extproc.gateway import Gateway, in_scope
from wakegate.extproc.h2grpc.call import Call
from wakegate.extproc.naming import (
    BadRequest,
    Resolved,
    model_from_headers,
    model_from_json,
    model_from_multipart,
    parse_json_body,
)
from wakegate.extproc.park import Tickets
from wakegate.extproc.process_call import ProcessCall
from wakegate.extproc.ratelimit import retry_after_header
from wakegate.extproc.responses import error, header, immediate
from wakegate.v1 import routing_pb2

log = logging.getLogger("wakegate.extproc")

_CONTINUE_BODY = ep.ProcessingResponse(request_body=ep.BodyResponse())
#: A request routed from its headers does not need its body buffered. The gateway's routes
#: already say so for X-Model-ID and /model/<name>/ requests; this covers any other Envoy setup.
_NO_BODY = processing_mode_pb2.ProcessingMode(request_body_mode=processing_mode_pb2.ProcessingMode.NONE)
_NO_BODY_COUNTED = processing_mode_pb2.ProcessingMode(
    request_body_mode=processing_mode_pb2.ProcessingMode.NONE,
    response_body_mode=processing_mode_pb2.ProcessingMode.STREAMED,
)


EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
PROCESS_METHOD = f"/{EXT_PROC_SERVICE}/Process"


#: The slice Envoy reads a connection into (16 KiB): a parked body smaller than this is sent back
#: to be copied out of it (`Processor._park`).
_READ_SLICE = 16 * 1024


class Processor:
    """Decides each ext_proc message; `call()` serves one ext_proc stream (one HTTP request)."""

    def __init__(self, gateway: Gateway, tickets: Tickets | None = None) -> None:
        self.gw = gateway
        #: Parking on (extproc/park.py): cold requests wait at this process's HTTP/2 port, not in
        #: their ext_proc streams. None: every cold request is held in its stream.
        self.tickets = tickets
        #: A released request came back (the park paces its releases by this).
        self.on_released: Callable[[], None] = lambda: None
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

    def decide(self, exchange: Exchange, message: ep.ProcessingRequest) -> ep.ProcessingResponse | Cold:
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

    def _on_response_body(self, ex: Exchange, message: ep.HttpBody) -> ep.ProcessingResponse:
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

    def _on_headers(self, ex: Exchange, message: ep.HttpHeaders) -> ep.ProcessingResponse | Cold:
        headers = headers_of(message)
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
        released = headers.get(RELEASE_HEADER)
        if released is not None:  # sent back by a park: admitted once already if the ticket says so
            read = self.tickets.read("release", released) if self.tickets is not None else None
            ex.release = read[0] if read is not None else ""
            if read is not None:
                self.on_released()
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
        return BUFFER_BODY_COUNTED if scope.tokens_per_minute else BUFFER_BODY

    def _on_body(self, ex: Exchange, message: ep.HttpBody) -> ep.ProcessingResponse | Cold:
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
        self, ex: Exchange, parsed: dict[str, Any] | None, raw_body: bytes | None, *, in_body: bool
    ) -> ep.ProcessingResponse | Cold:
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
        released = ex.release == route.key  # its first pass was admitted, then parked
        if scope.tokens_per_minute and not released:
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
            return BUFFER_BODY
        flow = route.key in self.gw.flow_keys  # a set lookup: a proto submessage costs ~0.4 µs
        if flow:
            refused = self._identify(ex, route)
            if refused is not None:
                return refused
        rate = route.rate_limit
        # Envoy's bucket took the token of a request it counted (it said so, for this model).
        counted = rate.counted_by_envoy and ex.headers.get(RATE_COUNTED_HEADER) == route.key
        wait = 0.0 if released else self.gw.limiter.admit(
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
            return Cold(resolved, parsed, raw_body, in_body, for_adapter=True, wanted=place.wanted)
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
            return self._flow_admit(ex, resolved, parsed, raw_body, in_body) or Cold(
                resolved, parsed, raw_body, in_body
            )
        if (
            self.tickets is not None
            and ex.release is None  # parked once at most: Envoy follows one redirect
            and lora is None
            and not scope.tokens_per_minute  # its stream stays open for the response anyway
            and (in_body or ex.headers_only)  # Envoy holds the whole body for the redirect
        ):
            if self.gw.cold.depth(route.key) >= route.cold.max_queue:
                return self._queue_full(route)
            return self._park(ex, route, in_body=in_body, body=raw_body)
        return Cold(resolved, parsed, raw_body, in_body)

    def _park(
        self, ex: Exchange, route: routing_pb2.ModelRoute, *, in_body: bool, body: bytes | None
    ) -> ep.ProcessingResponse:
        """Send a cold request on to wait at an extproc's park (extproc/park.py): its ext_proc
        stream ends here. Nothing else is changed: the request is decided again when released.
        `body`, the JSON body Envoy buffered, is sent back as it came when it is smaller than
        Envoy's read slice: Envoy keeps an HTTP/1.1 request's body in the 16 KiB slice its
        connection read it into, and keeps it while parked for the redirect; a body extproc sets
        is copied into a buffer of its own size (a 4 KiB page for most): 12 KB less per request
        held over HTTP/1.1 (docs/performance.md, "Scale"). A larger body fills its slices."""
        assert self.tickets is not None
        left = route.cold.activation_timeout_ms / 1000 - (time.monotonic() - ex.started)
        ticket = self.tickets.park(route.key, ex.model_name or route.key, time.time() + left)
        parked = [header(CLUSTER_HEADER, PARK_CLUSTER), header(PARK_HEADER, ticket)]
        common = ep.CommonResponse(header_mutation=ep.HeaderMutation(set_headers=parked), clear_route_cache=True)
        if in_body:
            if body is not None and len(body) < _READ_SLICE:
                common.body_mutation.body = body
            return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common))
        return ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common), mode_override=_NO_BODY)

    def _flow_admit(
        self, ex: Exchange, resolved: Resolved, parsed: dict[str, Any] | None, raw_body: bytes | None, in_body: bool
    ) -> ep.ProcessingResponse | Cold | None:
        """Flow control's admission: None (the request goes on now), held (for its turn), or refused."""
        route = resolved.route
        try:
            ticket = self.gw.flow.admit(route, ex.tenant, ex.band, ex.scope.weight)
        except Shed as exc:
            return self._shed(route, exc, ex)
        return None if ticket is None else Cold(resolved, parsed, raw_body, in_body, ticket=ticket)

    def _identify(self, ex: Exchange, route: routing_pb2.ModelRoute) -> ep.ProcessingResponse | None:
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

    def _shed(self, route: routing_pb2.ModelRoute, exc: Shed, ex: Exchange) -> ep.ProcessingResponse:
        """Flow control's refusal: 429 over the tenant's share, 503 when the model cannot take it."""
        self.gw.metrics.flow_shed.labels(route.key, self.gw.flow.label(ex.tenant), BANDS[ex.band], exc.code).inc()
        retry = self.gw.settings.flow_retry_after if exc.status == 429 else self.gw.settings.cold_retry_after
        return self._reject(route.key, exc.status, exc.code, str(exc), retry_after=str(retry))

    async def _admitted(self, ex: Exchange, cold: Cold, deadline: float) -> ep.ProcessingResponse:
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
        held = Cold(resolved, cold.parsed, cold.raw_body, cold.in_body)
        if not resolved.route.endpoints or adapter_route(resolved.route, resolved.adapter) is not None:
            # Cold again, or an adapter to place: the usual path, from the top.
            return await self.hold(ex, held, time.monotonic() + held.timeout_s())
        return self._forward(ex, resolved, cold.parsed, cold.raw_body, in_body=cold.in_body)

    async def hold(self, ex: Exchange, cold: Cold, deadline: float) -> ep.ProcessingResponse:
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
            return await self.hold(ex, Cold(resolved, cold.parsed, cold.raw_body, cold.in_body), deadline)
        if not cold.for_adapter:
            waited = self.gw.cold.flushed(resolved.route.key)
            if waited is not None:
                self.gw.metrics.cold_start.labels(resolved.route.key, "first_byte").observe(waited)
        lora = adapter_route(resolved.route, resolved.adapter)
        if lora is not None and place is None:
            place = placement(resolved.route, lora, self.gw.adapters.draw)
            if not place.endpoints:  # woken without it: wait for its load
                held = Cold(resolved, cold.parsed, cold.raw_body, cold.in_body, for_adapter=True, wanted=place.wanted)
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
            if isinstance(admitted, Cold):
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
        ex: Exchange,
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
        if ex.release is not None:
            removals.append(RELEASE_HEADER)
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
        ex: Exchange,
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
        if ex.release == route.key:  # a parked request sent on: the cold start's first byte
            woke = self.gw.cold.flushed(route.key)
            if woke is not None:
                self.gw.metrics.cold_start.labels(route.key, "first_byte").observe(woke)
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
        self, ex: Exchange, resolved: Resolved, parsed: dict[str, Any], raw_body: bytes | None, *, in_body: bool
    ) -> ep.ProcessingResponse:
        extra = [header(ACTIVATOR_MODEL_HEADER, resolved.route.key)]
        common = self._mutations(ex, resolved, parsed, raw_body, ACTIVATOR_CLUSTER, extra)
        self.gw.metrics.requests.labels(resolved.route.key, "200", "keepalive").inc()
        if in_body:
            return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common))
        return ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common), mode_override=_NO_BODY)

    def release(self, ex: Exchange) -> None:
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
