"""Building ext_proc responses: the one error shape at the HTTP edge, and routing mutations.

Every error the gateway itself produces is OpenAI-shaped JSON,
`{"error": {"message", "type", "code"}}`, with the matching HTTP status.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def error_body(status: int, code: str, message: str) -> bytes:
    error_type = _ERROR_TYPES.get(status, "server_error")
    return json.dumps({"error": {"message": message, "type": error_type, "code": code}}).encode()


def immediate(
    status: int,
    body: bytes,
    *,
    content_type: str = "application/json",
    extra_headers: Iterable[tuple[str, str]] = (),
    details: str = "",
) -> ep.ProcessingResponse:
    headers = [header("content-type", content_type), *(header(k, v) for k, v in extra_headers)]
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=ep.HeaderMutation(set_headers=headers),
            body=body,
            details=details,
        )
    )


def error(status: int, code: str, message: str, *, retry_after: str | None = None) -> ep.ProcessingResponse:
    extra = [("retry-after", retry_after)] if retry_after else []
    return immediate(status, error_body(status, code, message), extra_headers=extra, details=f"wakegate_{code}")
