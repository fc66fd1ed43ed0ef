"""One ext_proc stream's request as the Processor decides it (`Exchange`), a request it holds
cold (`Cold`), and the stream's fixed answers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from wakegate.contract import (
    UNSERVED_HEADER,
)
from wakegate.extproc.auth import ALL_MODELS, Scope
from wakegate.extproc.budget import Usage
from wakegate.extproc.flow import Ticket
from wakegate.extproc.naming import (
    Resolved,
)
from wakegate.extproc.responses import error_body, immediate

BUFFER_BODY = ep.ProcessingResponse(
    request_headers=ep.HeadersResponse(),
    mode_override=processing_mode_pb2.ProcessingMode(request_body_mode=processing_mode_pb2.ProcessingMode.BUFFERED),
)
#: The same for a tenant with a token budget: its response body streams past extproc, which reads
#: the engine's usage at its end (extproc/budget.py).
BUFFER_BODY_COUNTED = ep.ProcessingResponse(
    request_headers=ep.HeadersResponse(),
    mode_override=processing_mode_pb2.ProcessingMode(
        request_body_mode=processing_mode_pb2.ProcessingMode.BUFFERED,
        response_body_mode=processing_mode_pb2.ProcessingMode.STREAMED,
    ),
)


def headers_of(message: ep.HttpHeaders) -> dict[str, str]:
    return {
        h.key: (h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value) for h in message.headers.headers
    }


class Exchange:
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
        "release",
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
        #: Sent back by a park (extproc/park.py): the model key its valid release ticket names, ""
        #: for a ticket that is not (never parked again either way); None: not parked.
        self.release: str | None = None


@dataclass(slots=True)
class Cold:
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


#: What a request still held when extproc stops gets: the gateway's retriable 503, marked as having
#: reached no model server (the same words as Envoy's own reply when no extproc answers).
STOPPING = immediate(
    503,
    error_body(503, "gateway_unavailable", "the gateway is starting or restarting a component; retry shortly"),
    extra_headers=[("retry-after", "1"), (UNSERVED_HEADER, "1")],
    details="wakegate_gateway_unavailable",
)
