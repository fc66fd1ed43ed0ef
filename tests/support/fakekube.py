"""The one fake Kubernetes API server of the unit tests, under the real client.

`FakeApiServer.kube()` is a real `wakegate.control.k8s.client.Kube` whose transport answers from
memory, so a test runs the client's own paths, queries, content types and errors: objects by
path with resourceVersions (a stale PUT is a 409, a second create too), merge patches, server-side
apply of a status, deletes, and 404s worded as the API server words them. What it does not do:
field ownership, schemas, watches. The real API server runs in e2e/.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from wakegate.control.k8s.client import Kube

HOST = "http://fake-apiserver"


@dataclass
class Call:
    method: str
    path: str
    query: dict[str, str]
    body: Any


@dataclass
class _Response:
    status: int
    reason: str
    data: bytes

    def read(self) -> bytes:
        return self.data


def _merge(target: dict[str, Any], patch: Mapping[str, Any]) -> None:
    """RFC 7386: None deletes, a mapping merges, anything else replaces."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


@dataclass
class FakeApiServer:
    """Objects by their API path (`/api/v1/nodes/n`, `/apis/<group>/<version>/namespaces/<ns>/<plural>/<name>`)."""

    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    #: Errors the next requests get, in order, before any is served: (code, reason, message).
    faults: list[tuple[int, str, str]] = field(default_factory=list)
    #: Namespaces that do not exist: any request under one is a 404 naming it.
    missing_namespaces: set[str] = field(default_factory=set)
    version: int = 0

    def kube(self) -> Kube:
        return Kube(_Api(self))  # type: ignore[arg-type]

    def add(self, path: str, obj: Mapping[str, Any]) -> None:
        self.version += 1
        stored = copy.deepcopy(dict(obj))
        stored.setdefault("metadata", {})["resourceVersion"] = str(self.version)
        self.objects[path] = stored

    def writes(self, method: str, content_type_suffix: str = "") -> list[Call]:
        """The calls of `method` whose path ends with `content_type_suffix` (e.g. "/status")."""
        return [c for c in self.calls if c.method == method and c.path.endswith(content_type_suffix)]

    def handle(self, method: str, url: str, headers: Mapping[str, str], body: Any) -> _Response:
        parts = urlsplit(url)
        path, query = parts.path, dict(parse_qsl(parts.query))
        self.calls.append(Call(method, path, query, copy.deepcopy(body)))
        if self.faults:
            return self._status(*self.faults.pop(0))
        segments = path.split("/")
        if "namespaces" in segments:
            namespace = segments[segments.index("namespaces") + 1]
            if namespace in self.missing_namespaces:
                return self._status(404, "Not Found", f'namespaces "{namespace}" not found')
        try:
            return self._serve(method, path, headers.get("Content-Type", ""), body)
        except KeyError:
            return self._status(404, "Not Found", f"{path.rsplit('/', 1)[-1]} not found")

    def _serve(self, method: str, path: str, content_type: str, body: Any) -> _Response:
        status = path.endswith("/status")
        target = path.removesuffix("/status")
        if method == "GET":
            return self._ok(self.objects[target])
        if method == "DELETE":
            del self.objects[target]
            return self._ok({"kind": "Status", "status": "Success"})
        if method == "POST":
            created = f"{path}/{body['metadata']['name']}"
            if created in self.objects:
                return self._status(409, "Conflict", f"{body['metadata']['name']} already exists")
            self.add(created, body)
            return self._ok(self.objects[created])
        current = self.objects[target]
        if method == "PUT":
            if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
                return self._status(409, "Conflict", "the object has been modified")
            self.add(target, body)
        elif content_type == "application/merge-patch+json":
            merged = copy.deepcopy(current)
            _merge(merged, body)
            self.add(target, merged)
        elif status:  # server-side apply of the status subresource
            self.add(target, {**current, "status": copy.deepcopy(body["status"])})
        else:
            merged = copy.deepcopy(current)
            _merge(merged, body)
            self.add(target, merged)
        return self._ok(self.objects[target])

    @staticmethod
    def _ok(obj: Any) -> _Response:
        return _Response(200, "OK", json.dumps(obj).encode())

    @staticmethod
    def _status(code: int, reason: str, message: str) -> _Response:
        body = {"kind": "Status", "status": "Failure", "message": message, "reason": reason, "code": code}
        return _Response(code, reason, json.dumps(body).encode())


class _Configuration:
    host = HOST


class _Rest:
    def __init__(self, server: FakeApiServer) -> None:
        self.server = server

    def request(
        self, method: str, url: str, headers: Mapping[str, str], body: Any = None, _request_timeout: float = 0
    ) -> _Response:
        return self.server.handle(method, url, headers, body)


class _Api:
    """The part of kubernetes' ApiClient the real `Kube` uses."""

    def __init__(self, server: FakeApiServer) -> None:
        self.configuration = _Configuration()
        self.rest_client = _Rest(server)

    def update_params_for_auth(self, *args: Any) -> None:
        return None
