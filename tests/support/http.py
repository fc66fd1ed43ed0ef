"""Plain HTTP for tests: a request that returns error statuses instead of raising, and JSON GETs."""

from __future__ import annotations

import http.server
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any


def get_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


#: Envoy's count of ext_proc streams (the gateway listener's): a natively routed request opens none.
EXTPROC_STREAMS = r"http\.wakegate\.ext_proc\.streams_started"


def envoy_stat(admin: str, name: str, timeout: float = 2.0) -> int:
    """The value of the Envoy stat whose whole name matches `name` (a regex), from the admin API at
    `admin` (HOST:PORT); 0 while Envoy has not written it."""
    stats = get_json(f"http://{admin}/stats?format=json&filter=^{name}$", timeout)["stats"]
    return int(stats[0]["value"]) if stats else 0


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")


def request(
    method: str,
    url: str,
    *,
    headers: dict[str, str] | None = None,
    body: bytes | dict[str, Any] | None = None,
    timeout: float = 15.0,
) -> Response:
    """A plain HTTP request that returns error statuses instead of raising."""
    headers = dict(headers or {})
    data: bytes | None
    if isinstance(body, dict):
        data = json.dumps(body).encode()
        headers.setdefault("content-type", "application/json")
    else:
        data = body
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return Response(resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read())
    except urllib.error.HTTPError as exc:
        with exc:  # its connection, closed now rather than whenever it is collected
            return Response(exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read())


#: What a `LoopbackServer` answers: status, headers, body.
Reply = tuple[int, Mapping[str, str], bytes]


class LoopbackServer:
    """A threaded HTTP/1.1 server on 127.0.0.1 (any free port) whose every request is answered by
    `answer(method, path, headers, body)`; `close()` stops it."""

    def __init__(self, answer: Callable[[str, str, Mapping[str, str], bytes], Reply]) -> None:
        #: Requests answered so far.
        self.requests = 0
        lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def handle_one(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"] or 0))
                with lock:
                    server.requests += 1
                status, headers, out = answer(self.command, self.path, dict(self.headers.items()), body)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = handle_one

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
