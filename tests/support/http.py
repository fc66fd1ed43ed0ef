"""Plain HTTP for tests: a request that returns error statuses instead of raising, and JSON GETs."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
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
