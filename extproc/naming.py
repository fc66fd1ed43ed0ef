"""Which model a request is for: the name cascade and the route table that resolves names.

Cascade: `X-Model-ID` header, then a `/model/<name>/…` path prefix (stripped),
then the JSON body's `model`, then a multipart form's `model` field. The
route table maps every client-visible name (model name, served name, aliases,
LoRA adapters) to its model's route. Pure: no I/O.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from wakegate import contract
from wakegate.v1 import routing_pb2

_MAX_NAME = 253


class BadRequest(Exception):
    """The request cannot name a model; the message is safe to show the client."""

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class FromHeaders:
    """What the headers phase learned: a model name, or that the body must be read."""

    model: str | None
    #: Replacement for :path when a /model/<name>/ prefix was stripped.
    new_path: str | None = None


def model_from_headers(headers: Mapping[str, str]) -> FromHeaders:
    name = headers.get(contract.MODEL_HEADER)
    if name:
        return FromHeaders(_checked(name.strip()))
    path = headers.get(":path", "")
    if path.startswith(contract.MODEL_PATH_PREFIX):
        rest = path[len(contract.MODEL_PATH_PREFIX) :]
        name, slash, tail = rest.partition("/")
        if not name or not slash:
            raise BadRequest("path must look like /model/<name>/v1/...", "invalid_path")
        return FromHeaders(_checked(_unquote(name)), "/" + tail)
    return FromHeaders(None)


def _unquote(name: str) -> str:
    if "%" not in name:
        return name
    from urllib.parse import unquote

    return unquote(name)


def _checked(name: str) -> str:
    if not name or len(name) > _MAX_NAME or any(c.isspace() or ord(c) < 0x20 for c in name):
        raise BadRequest("model name is empty, too long or contains whitespace", "invalid_model")
    return name


def parse_json_body(body: bytes) -> dict[str, Any]:
    if not body:
        raise BadRequest("request body is empty; expected a JSON object with a `model` field", "empty_body")
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("request body is not valid JSON", "invalid_json") from None
    if not isinstance(parsed, dict):
        raise BadRequest("request body must be a JSON object", "invalid_json")
    return parsed


def model_from_json(parsed: Mapping[str, Any]) -> str:
    name = parsed.get("model")
    if not isinstance(name, str) or not name:
        raise BadRequest("request body has no `model` string", "model_required")
    return _checked(name)


_BOUNDARY = re.compile(r'boundary="?([^";]+)"?', re.IGNORECASE)
_MODEL_PART = re.compile(rb'content-disposition:[^\r\n]*;\s*name="?model"?(?:;|\r\n|$)', re.IGNORECASE)


def model_from_multipart(content_type: str, body: bytes) -> str:
    """The `model` field of a multipart/form-data body (the body itself is never changed)."""
    found = _BOUNDARY.search(content_type)
    if not found:
        raise BadRequest("multipart body without a boundary", "invalid_multipart")
    delimiter = b"--" + found.group(1).encode("latin-1")
    for part in body.split(delimiter)[1:]:
        head, sep, value = part.partition(b"\r\n\r\n")
        if not sep or not _MODEL_PART.search(head):
            continue
        text = value.removesuffix(b"\r\n").decode("utf-8", errors="strict").strip()
        return _checked(text)
    raise BadRequest("multipart form has no `model` field", "model_required")


@dataclass(frozen=True, slots=True)
class Resolved:
    route: routing_pb2.ModelRoute
    #: The name the backend must see in the JSON body (unchanged for LoRA adapters).
    body_model: str


class RouteTable:
    """Every client-visible name -> its model's route. Rebuilt whole on each xDS update."""

    def __init__(self, routes: Iterable[routing_pb2.ModelRoute] = ()) -> None:
        self.routes: dict[str, routing_pb2.ModelRoute] = {}
        self._by_name: dict[str, Resolved] = {}
        for route in routes:
            self.routes[route.key] = route
            for name in route.names:
                self._by_name.setdefault(name, Resolved(route, route.served_name))
            self._by_name.setdefault(route.served_name, Resolved(route, route.served_name))
            for adapter in route.lora_adapters:
                self._by_name.setdefault(adapter, Resolved(route, adapter))

    def resolve(self, name: str) -> Resolved | None:
        return self._by_name.get(name)

    def listing(self) -> list[dict[str, Any]]:
        """OpenAI `/v1/models` data: every served name and alias, adapters with their parent."""
        return [_model_object(name, resolved.route) for name, resolved in sorted(self._by_name.items())]

    def model_object(self, name: str) -> dict[str, Any] | None:
        """OpenAI `/v1/models/{name}`: the listing's entry for one name, None when no model has it."""
        resolved = self._by_name.get(name)
        return None if resolved is None else _model_object(name, resolved.route)


def _model_object(name: str, route: routing_pb2.ModelRoute) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "wakegate",
        "root": route.served_name,
    }
    if name in route.lora_adapters:
        entry["parent"] = route.served_name
    return entry
