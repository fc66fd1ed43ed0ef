"""The replies Envoy makes itself, in the gateway's one error shape (the listener's
`local_reply_config`).
"""

from __future__ import annotations

from typing import Any

from wakegate import contract


def _error_format(code: str, message: str, error_type: str) -> dict[str, Any]:
    """A local reply body in the gateway's one error shape (the same as extproc/responses.py)."""
    return {
        "json_format": {"error": {"message": message, "type": error_type, "code": code}},
        "content_type": "application/json",
    }


def _status(status: int, op: str = "EQ") -> dict[str, Any]:
    return {"status_code_filter": {"comparison": {"op": op, "value": {"default_value": status, "runtime_key": "_"}}}}


def _flags(*flags: str) -> dict[str, Any]:
    return {"response_flag_filter": {"flags": list(flags)}}


def _mapper(match: dict[str, Any], code: str, message: str, error_type: str) -> dict[str, Any]:
    return {"filter": match, "body_format_override": _error_format(code, message, error_type)}


def _cel(expression: str) -> dict[str, Any]:
    """An access-log filter matching replies for which the CEL `expression` holds."""
    return {
        "extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
                "expression": expression,
            },
        }
    }


#: The mark of a reply for a request that reached no model server (contract.UNSERVED_HEADER).
_UNSERVED_MARK: dict[str, Any] = {
    "header": {"key": contract.UNSERVED_HEADER, "value": "1"},
    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
}


def _gateway_unavailable(match: dict[str, Any], *, unserved: bool) -> dict[str, Any]:
    """The 503 + Retry-After for an ext_proc stream that failed; `unserved`: with the mark."""
    headers: list[dict[str, Any]] = [
        {"header": {"key": "retry-after", "value": "1"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
    ]
    if unserved:
        headers.append(_UNSERVED_MARK)
    message = "the gateway is starting or restarting a component; retry shortly"
    return {
        **_mapper(match, "gateway_unavailable", message, _SERVER),
        "status_code": 503,
        "headers_to_add": headers,
    }


#: A reply that carries a content type already was written by extproc (its errors are shaped,
#: /metrics is Prometheus text): it passes through unchanged. Envoy's own replies (codec
#: errors, limits, upstream failures, direct responses) have no content type at this point.
_WRITTEN_BY_EXTPROC = _cel("'content-type' in response.headers")


_CLIENT = "invalid_request_error"


_SERVER = "server_error"


#: The listener's local_reply_config: every reply Envoy makes itself becomes the OpenAI error
#: shape. The first mapper that matches wins; the body_format at the end takes the rest.
#: `%RESPONSE_CODE_DETAILS%` is Envoy's fixed token for why it answered (`http1.codec_error`,
#: `path_normalization_failed`, `missing_host_header`, ...): it names the problem without
#: echoing anything from the request.
LOCAL_REPLY_CONFIG: dict[str, Any] = {
    "mappers": [
        {
            "filter": _WRITTEN_BY_EXTPROC,
            "body_format_override": {"text_format_source": {"inline_string": "%LOCAL_REPLY_BODY%"}},
        },
        _mapper(_status(413), "body_too_large", "request body is larger than the gateway accepts", _CLIENT),
        _mapper(_status(431), "headers_too_large", "request headers are larger than the gateway accepts", _CLIENT),
        _mapper(_status(426), "unsupported_http_version", "the gateway accepts HTTP/1.1 and HTTP/2", _CLIENT),
        _mapper(_status(408), "request_timeout", "the request did not arrive in time", _CLIENT),
        _mapper(_status(404), "no_route", "no route for this request", _CLIENT),
        _mapper(
            _status(501),
            "not_implemented",
            "the gateway does not support this request: %RESPONSE_CODE_DETAILS%",
            _CLIENT,
        ),
        _mapper(_flags("UT"), "upstream_timeout", "the model server did not answer in time", _SERVER),
        # A connection that ended after the request went out (UC), or retries given up (URX,
        # where an earlier try may have been such a one): a model server may have the request.
        _mapper(_flags("URX", "UC"), "upstream_unavailable", "%LOCAL_REPLY_BODY%", _SERVER),
        # No upstream could be connected to (UF), none was there (UH, NC) or a limit refused it
        # (UO): nothing of the request left the gateway, so it is marked unserved (contract) and
        # a global gateway sends it to another member.
        {
            **_mapper(_flags("UH", "UF", "UO", "NC"), "upstream_unavailable", "%LOCAL_REPLY_BODY%", _SERVER),
            "headers_to_add": [_UNSERVED_MARK],
        },
        # extproc itself never answers 500 or 504: these are the gateway failing to
        # reach it (stream reset, message timeout). Upstream failures matched above.
        # No extproc answered (none running yet, or the one holding the request died): a
        # retriable 503 with Retry-After, never a 500 (docs/reliability.md). Marked unserved
        # (contract) where no upstream host was ever chosen for the request: with extproc's
        # default `--release-on access-log` that is every such reply, since its stream ends once
        # the request is routed; with `--release-on stream` the stream can also fail while a
        # model server has the request, and that reply is not marked.
        _gateway_unavailable(_cel("response.code == 500 && !has(upstream.address)"), unserved=True),
        _gateway_unavailable(_status(500), unserved=False),
        _mapper(_status(504), "gateway_timeout", "the gateway did not decide in time", _SERVER),
        _mapper(
            _status(400), "invalid_http_request", "the request is not valid HTTP: %RESPONSE_CODE_DETAILS%", _CLIENT
        ),
        _mapper(_status(500, "GE"), "gateway_error", "the gateway could not answer: %RESPONSE_CODE_DETAILS%", _SERVER),
    ],
    "body_format": _error_format(
        "request_refused", "the gateway refused the request: %RESPONSE_CODE_DETAILS%", _CLIENT
    ),
}


def _details(details: str) -> dict[str, Any]:
    """Matches a reply whose response code details (Envoy's fixed token for why) are `details`."""
    return _cel(f"response.code_details == '{details}'")


#: Envoy's api_key_auth answers on native routes, made extproc's (extproc/service.py): an unknown
#: key is its 401; a known key whose scope leaves the model out is the 404 of a model that does
#: not exist, named as asked (each native route is named after the name it matches). That 403 is
#: matched by its details (`client_not_allowed`), not its status: Envoy refuses an upgrade
#: (WebSocket) with a 403 of its own (`upgrade_failed`), which must stay `request_refused`.
_KEY_CHECK_REPLIES = [
    _mapper(_status(401), "invalid_api_key", "missing or invalid API key", "authentication_error"),
    {
        **_mapper(
            _details("client_not_allowed"), "model_not_found", "model '%ROUTE_NAME%' does not exist", "not_found_error"
        ),
        "status_code": 404,
    },
]


#: Envoy's own 429 (its local rate limit's) in extproc's words: the same code, type and message.
RATE_LIMITED_REPLY = _mapper(_status(429), "rate_limited", "rate limit exceeded; retry later", "rate_limit_error")


def local_replies(rate_limited: bool, key_checks: bool = False) -> dict[str, Any]:
    """LOCAL_REPLY_CONFIG, with the mappers of Envoy's own refusals right after extproc's
    pass-through: api_key_auth's where native routes check keys, the 429 where Envoy keeps buckets
    (otherwise Envoy never answers those itself)."""
    if not rate_limited and not key_checks:
        return LOCAL_REPLY_CONFIG
    first, *rest = LOCAL_REPLY_CONFIG["mappers"]
    own = [*(_KEY_CHECK_REPLIES if key_checks else []), *([RATE_LIMITED_REPLY] if rate_limited else [])]
    return {**LOCAL_REPLY_CONFIG, "mappers": [first, *own, *rest]}
