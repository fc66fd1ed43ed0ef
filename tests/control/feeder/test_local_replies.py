"""Envoy's own replies through the listener the feeder builds: each one is OpenAI-shaped JSON.

The real Envoy runs the generated listener (its HTTP filters and `local_reply_config` as
built) with a static route table that reaches each failure on purpose: a backend port that
refuses connections, a cluster with no endpoints, a backend that never answers, one that
closes the connection once the request arrived, an extproc
that is down and one that never answers. The whole gateway (tests/gateway) shows the client
side of the same mapping for codec errors and limits.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format

from tests.support.http import LoopbackServer
from wakegate import contract
from wakegate.control.admin import free_port
from wakegate.control.feeder import listeners
from wakegate.control.feeder.replies import LOCAL_REPLY_CONFIG
from wakegate.control.feeder.routes import route_configuration
from wakegate.control.feeder.settings import GatewaySettings

EXT_PROC = "envoy.filters.http.ext_proc"
PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"


def claims_unserved() -> LoopbackServer:
    """An HTTP server whose every reply is a 503 saying, falsely, that no model server saw it."""
    body = b'{"error": {"message": "busy", "type": "server_error", "code": "busy"}}'
    headers = {contract.UNSERVED_HEADER: "1", "content-type": "application/json"}
    return LoopbackServer(lambda *_: (503, headers, body))


class Silent:
    """A TCP server that accepts connections and reads them, and never says a word; `cut`: it
    closes each connection once a request arrived on it (a model server dying mid-request)."""

    def __init__(self, *, cut: bool = False) -> None:
        self.cut = cut
        self.requests = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            if self.cut:
                threading.Thread(target=self._cut, args=(conn,), daemon=True).start()

    def _cut(self, conn: socket.socket) -> None:
        with conn:
            if conn.recv(65536):
                self.requests += 1

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


def cluster(name: str, port: int | None, *, http2: bool = False) -> dict[str, Any]:
    endpoints = (
        []
        if port is None
        else [{"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]
    )
    built: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": endpoints}]},
    }
    if http2:
        built["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return built


def case(name: str, action: dict[str, Any], ext_proc: dict[str, Any]) -> dict[str, Any]:
    return {
        "match": {"prefix": "/", "headers": [{"name": "x-case", "string_match": {"exact": name}}]},
        **action,
        "typed_per_filter_config": {EXT_PROC: {"@type": PER_ROUTE, **ext_proc}},
    }


NO_EXT_PROC = {"disabled": True}
AFTER_UPSTREAM = {"request_header_mode": "SKIP", "request_body_mode": "NONE", "response_header_mode": "SEND"}


@pytest.fixture(scope="module")
def served() -> Iterator[LoopbackServer]:
    """The backend of the case whose ext_proc stream fails after the backend answered."""
    server = LoopbackServer(lambda *_: (200, {"content-type": "application/json"}, b'{"object": "list", "data": []}'))
    yield server
    server.close()


@pytest.fixture(scope="module")
def cut() -> Iterator[Silent]:
    """The backend that closes the connection once the request reached it."""
    server = Silent(cut=True)
    yield server
    server.close()


@pytest.fixture(scope="module")
def envoy(tmp_path_factory: pytest.TempPathFactory, served: LoopbackServer, cut: Silent) -> Iterator[int]:
    tmp: Path = tmp_path_factory.mktemp("local-replies")
    silent = Silent()
    claims = claims_unserved()
    port = free_port()
    settings = GatewaySettings(listen_port=port, extproc_message_timeout_ms=1000)
    listener = json_format.MessageToDict(listeners.listener(settings), preserving_proto_field_name=True)
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm.pop("rds")
    routes = json_format.MessageToDict(route_configuration(settings), preserving_proto_field_name=True)
    catch_all = routes["virtual_hosts"][0]["routes"][-1]["direct_response"]  # before extproc names a cluster
    hcm["route_config"] = {
        "response_headers_to_remove": routes["response_headers_to_remove"],
        "virtual_hosts": [
            {
                "name": "cases",
                "domains": ["*"],
                "routes": [
                    case("refused", {"route": {"cluster": "refused"}}, NO_EXT_PROC),
                    case("empty", {"route": {"cluster": "empty"}}, NO_EXT_PROC),
                    case("cut", {"route": {"cluster": "cut"}}, NO_EXT_PROC),
                    case("slow", {"route": {"cluster": "silent", "timeout": "0.5s"}}, NO_EXT_PROC),
                    case("extproc-down", {"route": {"cluster": "refused"}}, {"overrides": {}}),
                    case(
                        "extproc-silent",
                        {"route": {"cluster": "refused"}},
                        {"overrides": {"grpc_service": {"envoy_grpc": {"cluster_name": "silent_grpc"}}}},
                    ),
                    case("direct", {"direct_response": catch_all}, NO_EXT_PROC),
                    case("claims-unserved", {"route": {"cluster": "claims"}}, NO_EXT_PROC),
                    # The stream first opens for the response (as with `--release-on stream`, where it
                    # stays open while the model server has the request), and cannot connect.
                    case(
                        "extproc-down-after-upstream",
                        {"route": {"cluster": "served"}},
                        {"overrides": {"processing_mode": AFTER_UPSTREAM}},
                    ),
                ],
            }
        ]
    }
    closed = free_port()  # nothing listens there
    config = {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [listener],
            "clusters": [
                cluster("refused", closed),
                cluster("empty", None),
                cluster("cut", cut.port),
                cluster("silent", silent.port),
                cluster("silent_grpc", silent.port, http2=True),
                cluster("claims", claims.port),
                cluster("served", served.port),
                cluster(contract.EXTPROC_CLUSTER, closed, http2=True),
            ],
        },
    }
    path = tmp / "envoy.json"
    path.write_text(json.dumps(config))
    log = (tmp / "envoy.log").open("wb")
    envoy = Path(sys.executable).parent / "envoy"
    proc = subprocess.Popen(
        [str(envoy), "-c", str(path), "--use-dynamic-base-id", "--concurrency", "1", "-l", "warning"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp / "envoy.log").read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "Envoy never listened"
                time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
        silent.close()
        claims.close()


def exchange(port: int, name: str) -> tuple[int, Any, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers={"x-case": name})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.headers, exc.read()


@pytest.mark.parametrize(
    ("name", "status", "code", "error_type"),
    [
        ("refused", 503, "upstream_unavailable", "server_error"),  # connection refused (UF)
        ("empty", 503, "upstream_unavailable", "server_error"),  # no healthy upstream (UH)
        ("cut", 503, "upstream_unavailable", "server_error"),  # the connection ended after the request (UC)
        ("slow", 504, "upstream_timeout", "server_error"),  # route timeout (UT)
        ("extproc-down", 503, "gateway_unavailable", "server_error"),  # the ext_proc stream fails
        ("extproc-down-after-upstream", 503, "gateway_unavailable", "server_error"),  # ... with a server's answer
        ("extproc-silent", 504, "gateway_timeout", "server_error"),  # extproc's message timeout
        ("direct", 404, "no_route", "invalid_request_error"),  # the route table's catch-all
    ],
)
def test_envoy_failures_reach_the_client_as_openai_errors(
    envoy: int, served: LoopbackServer, cut: Silent, name: str, status: int, code: str, error_type: str
) -> None:
    got_status, headers, raw = exchange(envoy, name)
    assert (got_status, headers["content-type"]) == (status, "application/json")
    body = json.loads(raw)
    assert set(body) == {"error"}
    assert (body["error"]["code"], body["error"]["type"]) == (code, error_type)
    assert body["error"]["message"]
    # Only a request that reached no model server is marked so (safe to send again anywhere): one
    # no extproc could decide and that went to no upstream, one whose backend refused the
    # connection or had no endpoint; not one a server answered before the stream failed, nor one
    # that timed out upstream or whose connection ended after the request went out.
    unserved = name in ("extproc-down", "refused", "empty")
    assert headers.get(contract.UNSERVED_HEADER) == ("1" if unserved else None)
    if name == "extproc-down-after-upstream":
        assert served.requests >= 1  # the server did have it
    if name == "cut":
        assert cut.requests >= 1  # the server did have it


def test_a_backend_cannot_mark_its_own_reply_unserved(envoy: int) -> None:
    """Were a model server's 503 to carry the marker, a global gateway would send the request to
    another member after a server had it: the gateway's route table drops the marker."""
    status, headers, body = exchange(envoy, "claims-unserved")
    assert (status, json.loads(body)["error"]["code"]) == (503, "busy")  # the backend's own reply
    assert contract.UNSERVED_HEADER not in headers


def test_the_shape_is_the_one_extproc_uses() -> None:
    from wakegate.extproc.responses import error_body

    extproc_keys = set(json.loads(error_body(400, "x", "y"))["error"])
    for mapper in LOCAL_REPLY_CONFIG["mappers"][1:]:
        assert set(mapper["body_format_override"]["json_format"]["error"]) == extproc_keys
    assert set(LOCAL_REPLY_CONFIG["body_format"]["json_format"]["error"]) == extproc_keys
