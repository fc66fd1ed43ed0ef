"""The ext_proc stream handler: one bidirectional stream per HTTP request.

Order of decisions for each request, cheapest first, nothing queued before auth:
open paths (/healthz, /metrics) -> auth -> model from header or path (else ask
Envoy for the buffered body) -> resolve name -> rate limit -> endpoint pick ->
mutations (cluster header, endpoint header + envoy.lb metadata, body rewrite).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2
from prometheus_client import generate_latest
from wakegate.v1 import routing_pb2

from extproc.auth import ApiKeys
from extproc.metrics import Metrics
from extproc.naming import (
    BadRequest,
    RouteTable,
    model_from_headers,
    model_from_json,
    model_from_multipart,
    parse_json_body,
)
from extproc.picking import Picker
from extproc.ratelimit import RateLimiter, retry_after_header
from extproc.responses import error, header, immediate

log = logging.getLogger("wakegate.extproc")

CLUSTER_HEADER = "x-wakegate-cluster"
DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"

_STRATEGY_NAMES = {
    routing_pb2.STRATEGY_DEFAULT: "default",
    routing_pb2.STRATEGY_SESSION_AFFINITY: "session-affinity",
    routing_pb2.STRATEGY_PREFIX: "prefix",
    routing_pb2.STRATEGY_LEAST_LOADED: "least-loaded",
}
_BUFFER_BODY = ep.ProcessingResponse(
    request_headers=ep.HeadersResponse(),
    mode_override=processing_mode_pb2.ProcessingMode(
        request_body_mode=processing_mode_pb2.ProcessingMode.BUFFERED
    ),
)
_CONTINUE_BODY = ep.ProcessingResponse(request_body=ep.BodyResponse())


@dataclass
class Settings:
    """How this extproc decides; one object per process."""

    #: Largest body buffered to find `model` (the listener enforces the same bound).
    max_body_bytes: int = 8 * 1024 * 1024
    #: Token bucket over all models, requests/s (0 = unlimited) and burst.
    global_rate: float = 0.0
    global_burst: float = 0.0


class Gateway:
    """State shared by every stream of one extproc process."""

    def __init__(self, settings: Settings, keys: ApiKeys, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.keys = keys
        self.metrics = metrics or Metrics()
        self.table = RouteTable()
        self.limiter = RateLimiter(settings.global_rate or None, settings.global_burst or None)
        self.picker = Picker()
        self._models_body = b'{"object":"list","data":[]}'

    def set_routes(self, routes: list[routing_pb2.ModelRoute]) -> None:
        self.table = RouteTable(routes)
        self._models_body = json.dumps({"object": "list", "data": self.table.listing()}).encode()
        self.metrics.routes.set(len(self.table.routes))
        self.metrics.route_updates.inc()

    @property
    def models_body(self) -> bytes:
        return self._models_body


def _headers(message: ep.HttpHeaders) -> dict[str, str]:
    return {
        h.key: (h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value)
        for h in message.headers.headers
    }


class _Exchange:
    """Per-request state between the headers and body phases."""

    __slots__ = ("endpoint", "headers", "model_key", "model_name", "new_path", "started")

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.model_name: str | None = None
        self.new_path: str | None = None
        self.endpoint: str | None = None
        self.model_key: str | None = None
        self.started = time.perf_counter()


class Processor(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ep.ProcessingResponse]:
        exchange = _Exchange()
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("request")
                if kind == "request_headers":
                    exchange.started = time.perf_counter()
                    yield self._on_headers(exchange, message.request_headers)
                elif kind == "request_body":
                    yield self._on_body(exchange, message.request_body)
                elif kind == "response_headers":
                    yield ep.ProcessingResponse(response_headers=ep.HeadersResponse())
                elif kind == "response_body":
                    yield ep.ProcessingResponse(response_body=ep.BodyResponse())
                elif kind == "request_trailers":
                    yield ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
                elif kind == "response_trailers":
                    yield ep.ProcessingResponse(response_trailers=ep.TrailersResponse())
        finally:
            self._finish(exchange)

    # -- phases ---------------------------------------------------------------------------------

    def _on_headers(self, ex: _Exchange, message: ep.HttpHeaders) -> ep.ProcessingResponse:
        headers = _headers(message)
        ex.headers = headers
        path = headers.get(":path", "")
        if path in ("/healthz", "/metrics") and headers.get(":method") == "GET":
            return self._open_path(path)
        if not self.gw.keys.check(headers.get("authorization")):
            return self._reject(None, 401, "invalid_api_key", "missing or invalid API key")
        if path.split("?", 1)[0] in ("/v1/models", "/models") and headers.get(":method") == "GET":
            return self._done(None, immediate(200, self.gw.models_body))
        try:
            found = model_from_headers(headers)
        except BadRequest as exc:
            return self._reject(None, 400, exc.code, str(exc))
        ex.new_path = found.new_path
        if found.model is not None:
            ex.model_name = found.model
            return self._route(ex, None, None, in_body=False)
        # The model is in the body: check what we can before asking Envoy to buffer it.
        if message.end_of_stream:
            return self._reject(
                None,
                400,
                "model_required",
                "no model named: send X-Model-ID, /model/<name>/..., or a body with `model`",
            )
        content_type = headers.get("content-type", "").lower()
        if not (
            content_type.startswith("application/json") or content_type.startswith("multipart/form-data")
        ):
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
                    None,
                    413,
                    "body_too_large",
                    f"request body exceeds {self.gw.settings.max_body_bytes} bytes",
                )
        return _BUFFER_BODY

    def _on_body(self, ex: _Exchange, message: ep.HttpBody) -> ep.ProcessingResponse:
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
                ex.model_name = model_from_multipart(content_type, body)
                return self._route(ex, None, None, in_body=True)
            parsed = parse_json_body(body)
            ex.model_name = model_from_json(parsed)
        except BadRequest as exc:
            return self._reject(None, 400, exc.code, str(exc))
        return self._route(ex, parsed, body, in_body=True)

    # -- decisions ------------------------------------------------------------------------------

    def _route(
        self, ex: _Exchange, parsed: dict[str, Any] | None, raw_body: bytes | None, *, in_body: bool
    ) -> ep.ProcessingResponse:
        assert ex.model_name is not None
        resolved = self.gw.table.resolve(ex.model_name)
        if resolved is None:
            return self._reject(None, 404, "model_not_found", f"model {ex.model_name!r} does not exist")
        route = resolved.route
        rate = route.rate_limit
        wait = self.gw.limiter.admit(route.key, rate.requests_per_second or None, rate.burst or None)
        if wait > 0:
            return self._reject(
                route.key,
                429,
                "rate_limited",
                "rate limit exceeded; retry later",
                retry_after=retry_after_header(wait),
            )
        if not route.endpoints:
            return self._reject(
                route.key,
                503,
                "model_not_ready",
                f"model {ex.model_name!r} has no ready backend",
                retry_after="5",
            )
        endpoints = [f"{e.address}:{e.port}" for e in route.endpoints]
        strategy = _STRATEGY_NAMES.get(route.strategy, "default")
        endpoint = self.gw.picker.pick(route.key, strategy, endpoints, ex.headers, parsed)
        mutations = [header(CLUSTER_HEADER, route.cluster)]
        removals: list[str] = []
        metadata: struct_pb2.Struct | None = None
        if endpoint is not None:
            mutations.append(header(DESTINATION_HEADER, endpoint))
            metadata = struct_pb2.Struct()
            metadata.get_or_create_struct(LB_NAMESPACE)[DESTINATION_HEADER] = endpoint
        elif DESTINATION_HEADER in ex.headers:
            removals.append(DESTINATION_HEADER)  # a client may not choose the backend itself
        if ex.new_path is not None:
            mutations.append(header(":path", ex.new_path))
        body_mutation = None
        if parsed is not None and raw_body is not None and parsed.get("model") != resolved.body_model:
            parsed["model"] = resolved.body_model
            new_body = json.dumps(parsed, ensure_ascii=False, separators=(",", ":")).encode()
            body_mutation = ep.BodyMutation(body=new_body)
            mutations.append(header("content-length", str(len(new_body))))
        common = ep.CommonResponse(
            header_mutation=ep.HeaderMutation(set_headers=mutations, remove_headers=removals),
            body_mutation=body_mutation,
            clear_route_cache=True,
        )
        ex.model_key = route.key
        ex.endpoint = endpoint
        self.gw.metrics.requests.labels(route.key, "routed").inc()
        self.gw.metrics.in_flight.labels(route.key).inc()
        if endpoint is not None:
            self.gw.picker.inflight.acquire(endpoint)
        self.gw.metrics.pick_seconds.observe(time.perf_counter() - ex.started)
        if not in_body:
            return ep.ProcessingResponse(
                request_headers=ep.HeadersResponse(response=common), dynamic_metadata=metadata
            )
        return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common), dynamic_metadata=metadata)

    def _finish(self, ex: _Exchange) -> None:
        if ex.model_key is None:
            return
        self.gw.metrics.in_flight.labels(ex.model_key).dec()
        if ex.endpoint is not None:
            self.gw.picker.inflight.release(ex.endpoint)
        ex.model_key = None

    def _open_path(self, path: str) -> ep.ProcessingResponse:
        if path == "/healthz":
            return immediate(200, b'{"status":"ok"}')
        return immediate(
            200,
            generate_latest(self.gw.metrics.registry),
            content_type="text/plain; version=0.0.4; charset=utf-8",
        )

    def _reject(
        self, model_key: str | None, status: int, code: str, message: str, *, retry_after: str | None = None
    ) -> ep.ProcessingResponse:
        return self._done(model_key, error(status, code, message, retry_after=retry_after), str(status))

    def _done(
        self, model_key: str | None, response: ep.ProcessingResponse, code: str = "200"
    ) -> ep.ProcessingResponse:
        self.gw.metrics.requests.labels(model_key or "", code).inc()
        return response


def header_map(mutation: ep.HeaderMutation) -> Mapping[str, str]:
    """Header mutation as a plain mapping (tests and logs)."""
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
