"""Requests Envoy refuses before extproc sees them: still OpenAI-shaped JSON, over raw sockets.

No client library sends these (bad request lines, forbidden characters, header blocks over the
limit, HTTP/1.0, a path that normalizes to nothing), so they go out as bytes. On HTTP/2 a
malformed request has no reply by the protocol's rules (RFC 9113, 8.1.1): it resets its own
stream, and the other streams of the connection go on.
"""

from __future__ import annotations

import pytest

from tests.gateway.conftest import API_KEY
from tests.support.rawhttp import http1, http2
from tests.support.up import UpProcess
from wakegate.extproc.h2grpc.frames import COMPRESSION_ERROR

GOOD_HEAD = b"GET /v1/models HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + API_KEY.encode() + b"\r\n"


@pytest.mark.parametrize(
    ("data", "status", "code"),
    [
        (b"G@T / HTTP/1.1\r\nhost: x\r\n\r\n", 400, "invalid_http_request"),
        (b"\x00\x01\x02 not http\r\n\r\n", 400, "invalid_http_request"),
        (b"GET / HTTP/1.1\r\nhost: x\r\nx-a\x01b: 1\r\n\r\n", 400, "invalid_http_request"),
        (b"GET / HTTP/1.1\r\nhost: x\r\nx-a: \x7f\x00\r\n\r\n", 400, "invalid_http_request"),
        (b"GET v1/models HTTP/1.1\r\nhost: x\r\n\r\n", 400, "invalid_http_request"),
        (b"GET /v1/ models HTTP/1.1\r\nhost: x\r\n\r\n", 400, "invalid_http_request"),
        (b"GET /v1/models HTTP/1.1\r\n\r\n", 400, "invalid_http_request"),  # no host
        (b"GET /model/%00/v1/models HTTP/1.1\r\nhost: x\r\n\r\n", 400, "invalid_http_request"),
        (b"POST /model/%00/v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}", 400,
         "invalid_http_request"),
        (b"GET /v1/models#frag HTTP/1.1\r\nhost: x\r\n\r\n", 400, "invalid_http_request"),
        (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n"
         b"0\r\n\r\n", 400, "invalid_http_request"),
        (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: abc\r\n\r\n", 400, "invalid_http_request"),
        (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
         b"transfer-encoding: chunked\r\n\r\nzz\r\n", 400, "invalid_http_request"),
        (GOOD_HEAD + b"x-big: " + b"a" * 70_000 + b"\r\n\r\n", 431, "headers_too_large"),
        (GOOD_HEAD + b"".join(b"x-h%d: 1\r\n" % i for i in range(200)) + b"\r\n", 431, "headers_too_large"),
        (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\nhost: x\r\n\r\n", 431, "headers_too_large"),
        (b"GET /v1/models HTTP/1.0\r\n\r\n", 426, "unsupported_http_version"),
        (b"GET /v1/models HTTP/9.9\r\nhost: x\r\n\r\n", 426, "unsupported_http_version"),
        (GOOD_HEAD + b"connection: upgrade\r\nupgrade: websocket\r\n\r\n", 403, "request_refused"),
        (b"POST /model/chat-n/v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + API_KEY.encode()
         + b"\r\nconnection: upgrade\r\nupgrade: websocket\r\ncontent-length: 2\r\n\r\n{}", 403,
         "request_refused"),  # the native model's route, where Envoy checks keys itself
        (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip\r\n\r\n", 501, "not_implemented"),
    ],
    ids=[
        "bad-method", "garbage", "header-name-char", "header-value-char", "path-without-slash", "space-in-path",
        "no-host", "nul-in-model-path", "nul-in-model-path-post", "fragment", "length-and-chunked",
        "length-not-a-number", "bad-chunk", "header-70k", "200-headers", "url-70k", "http-1.0", "http-9.9",
        "websocket-upgrade", "websocket-upgrade-native-route", "gzip-transfer-encoding",
    ],
)  # fmt: skip
def test_http1_requests_envoy_refuses_get_shaped_errors(
    gateway: UpProcess, data: bytes, status: int, code: str
) -> None:
    reply = http1(gateway.port, data)
    assert reply.status == status, reply
    assert reply.error()["code"] == code


GET = [(":method", "GET"), (":scheme", "http"), (":authority", "x")]
AUTH = ("authorization", f"Bearer {API_KEY}")
MODELS = [*GET, (":path", "/v1/models"), AUTH]


@pytest.mark.parametrize("path", ["/model/%00/v1/models", "/v1/models#frag"])
def test_http2_path_that_cannot_be_normalized_gets_a_shaped_400(gateway: UpProcess, path: str) -> None:
    reply = http2(gateway.port, [([*GET, (":path", path), AUTH], b"")])[1]
    assert reply.status == 400, reply
    assert reply.error()["code"] == "invalid_http_request"


@pytest.mark.parametrize(
    "headers",
    [
        [*GET, AUTH],  # no :path
        [*MODELS, ("X-Upper", "1")],
        [*MODELS, ("x-a", "a\x00b")],
        [*MODELS, ("x-a", "a\r\nx-b: c")],
        [*MODELS, ("te", "gzip")],
        [*MODELS, ("connection", "keep-alive")],
        [("x-a", "1"), *MODELS],  # a pseudo-header after a regular one
        [*MODELS, (":foo", "1")],
        [(":method", "G@T"), *MODELS[1:]],
        [*GET, (":path", "v1/models"), AUTH],
        [*GET, (":path", "/v1/ models"), AUTH],
        [*MODELS, *[(f"x-h{i}", "1") for i in range(200)]],
    ],
    ids=[
        "no-path", "upper-case-name", "nul-in-value", "crlf-in-value", "te-gzip", "connection-header",
        "pseudo-after-regular", "unknown-pseudo", "bad-method", "path-without-slash", "space-in-path", "200-headers",
    ],
)  # fmt: skip
def test_malformed_http2_request_resets_only_its_stream(gateway: UpProcess, headers: list[tuple[str, str]]) -> None:
    replies = http2(gateway.port, [(headers, b""), (MODELS, b"")])
    assert replies[1].ended.startswith("reset:"), replies[1]
    assert replies[3].status == 200 and replies[3].ended == "", replies[3]


def test_http2_header_block_over_the_limit_ends_its_connection_only(gateway: UpProcess) -> None:
    """HPACK state cannot be kept once a block is refused half-read: the connection goes (GOAWAY)."""
    replies = http2(gateway.port, [([*MODELS, ("x-big", "a" * 70_000)], b"")])
    assert replies[1].ended == f"goaway:{COMPRESSION_ERROR}", replies[1]
    assert http2(gateway.port, [(MODELS, b"")])[1].status == 200


def test_extproc_replies_pass_through_unchanged(gateway: UpProcess) -> None:
    """The reshaping leaves extproc's own answers alone: its errors and JSON (Prometheus text:
    tests/gateway/test_keys.py, on a gateway that serves /metrics publicly)."""
    refused = http1(gateway.port, b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
    assert refused.status == 401 and refused.error()["code"] == "invalid_api_key"
    metrics = http1(gateway.port, b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
    assert metrics.status == 404 and metrics.error()["code"] == "not_found"
    models = http1(gateway.port, GOOD_HEAD + b"\r\n")
    assert models.status == 200 and models.headers["content-type"] == "application/json"
    assert b'"object": "list"' in models.body
