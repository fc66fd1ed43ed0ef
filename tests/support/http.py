"""Plain HTTP for tests: a request that returns error statuses instead of raising, and JSON GETs."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def get_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


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
