"""Which model a request is for: the name cascade and the route table that resolves names.

Cascade: `X-Model-ID` header, then a `/model/<name>/…` path prefix (stripped),
then the JSON body's `model`, then a multipart form's `model` field. The
route table maps every client-visible name (model name, served name, aliases,
LoRA adapters) to its model's route; an adapter's name also says what the engine must be told
(vLLM: the adapter's name as `model`; llama.cpp: the base's name and `lora: [{id, scale}]`). Pure: no I/O.

A JSON body is refused (400) when the gateway could not read it the way a backend would:
not UTF-8, nested deeper than :data:`MAX_JSON_DEPTH`, or naming `model` twice (the gateway
would route by one and a backend might read the other). A multipart form likewise.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from wakegate import contract
from wakegate.v1 import routing_pb2

_MAX_NAME = 253

#: Deepest nesting of arrays and objects a JSON body may have (docs/decisions.md). Python's
#: parser fails near 1,000 levels; real requests (tool schemas included) stay far below this.
MAX_JSON_DEPTH = 128


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
        # A UTF-8 byte-order mark is skipped (the "utf-8-sig" codec does it ten times slower).
        text = (body[3:] if body.startswith(b"\xef\xbb\xbf") else body).decode()
    except UnicodeDecodeError:
        raise BadRequest("request body is not valid UTF-8", "invalid_json") from None
    try:
        parsed = json.loads(text)
    except RecursionError:
        raise _too_deep() from None
    except ValueError:
        raise BadRequest("request body is not valid JSON", "invalid_json") from None
    if not isinstance(parsed, dict):
        raise BadRequest("request body must be a JSON object", "invalid_json")
    # Nearly every body has too few brackets to nest past the limit: two byte counts say so.
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and nested_deeper_than(parsed, MAX_JSON_DEPTH):
        raise _too_deep()
    if len(_MODEL_KEY.findall(body)) > 1 and _names_model_twice(text):
        raise BadRequest("request body names `model` more than once", "duplicate_model")
    return parsed


def _too_deep() -> BadRequest:
    return BadRequest(f"request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels", "json_too_deep")


#: Every spelling of the JSON string "model": each letter as itself or as a \u escape.
_MODEL_KEY = re.compile(rb'"(?:m|\\u006[dD])(?:o|\\u006[fF])(?:d|\\u0064)(?:e|\\u0065)(?:l|\\u006[cC])"')
_CONTAINERS = (dict, list)


def nested_deeper_than(value: dict[str, Any] | list[Any], limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` levels in a parsed JSON value (itself level 1).

    Level by level; the containers of each level are picked out with C-level iterators, so a long
    string costs nothing and a long array of numbers one pass.
    """
    level: list[Any] = [value]
    for _ in range(limit):
        below: list[Any] = []
        for container in level:
            items = container.values() if type(container) is dict else container
            below.extend(itertools.compress(items, map(isinstance, items, itertools.repeat(_CONTAINERS))))
        if not below:
            return False
        level = below
    return True


def _names_model_twice(text: str) -> bool:
    """Whether the top-level object has two `model` keys (its pairs are the parser's last call)."""
    top_level_twice = False

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal top_level_twice
        top_level_twice = sum(1 for key, _ in items if key == "model") > 1
        return dict(items)

    json.loads(text, object_pairs_hook=pairs)
    return top_level_twice


def rewritten(parsed: dict[str, Any], model: str, lora: tuple[int, float] | None = None) -> bytes:
    """The body with its `model` set to `model` (and llama.cpp's `lora` list set to the one
    adapter `lora` = (id, scale), replacing the client's), re-encoded (UTF-8, compact)."""
    parsed["model"] = model
    if lora is not None:
        parsed["lora"] = [{"id": lora[0], "scale": lora[1]}]
    try:
        return json.dumps(parsed, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        # A \ud800-\udfff escape without its pair parses to a lone surrogate, which UTF-8 cannot
        # carry; the body passes unchanged when its model needs no rewrite.
        raise BadRequest(
            "request body has an unpaired UTF-16 surrogate escape (\\ud800-\\udfff); "
            "it cannot be re-encoded as UTF-8 when the model name is rewritten",
            "invalid_unicode",
        ) from None


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
    delimiter = b"--" + found.group(1).encode()
    names = []
    for part in body.split(delimiter)[1:]:
        head, sep, value = part.partition(b"\r\n\r\n")
        if sep and _MODEL_PART.search(head):
            names.append(value.removesuffix(b"\r\n"))
    if not names:
        raise BadRequest("multipart form has no `model` field", "model_required")
    if len(names) > 1:
        raise BadRequest("multipart form has more than one `model` field", "duplicate_model")
    try:
        text = names[0].decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("multipart `model` field is not valid UTF-8", "invalid_model") from None
    return _checked(text.strip())


@dataclass(frozen=True, slots=True)
class Resolved:
    route: routing_pb2.ModelRoute
    #: The name the backend must see in the JSON body (unchanged for `lora_adapters` names).
    body_model: str
    #: The LoRAAdapter asked for (its served name), or None.
    adapter: str | None = None
    #: llama.cpp: (id, scale) of the adapter, set as the body's `lora` list.
    lora: tuple[int, float] | None = None
    #: A LoRAAdapter object's name: the body tells the engine which adapter, so it must be read
    #: even when the headers name the model.
    needs_body: bool = False

    def needs_rewrite(self, parsed: Mapping[str, Any]) -> bool:
        """Whether the body must change before the backend sees it."""
        if parsed.get("model") != self.body_model:
            return True
        return self.lora is not None and parsed.get("lora") != [{"id": self.lora[0], "scale": self.lora[1]}]

    def rewrite(self, parsed: dict[str, Any]) -> bytes:
        return rewritten(parsed, self.body_model, self.lora)


def _resolutions(route: routing_pb2.ModelRoute) -> list[tuple[str, Resolved]]:
    """(name, what it resolves to) for every name a route answers to, in precedence order."""
    out: list[tuple[str, Resolved]] = []
    base = Resolved(route, route.served_name)
    ids = [lora.lora_id for lora in route.adapters if lora.HasField("lora_id")]
    if ids:
        # llama.cpp's server keeps a slot's prompt cache when a request names no `lora`
        # list, even if the slot last ran with an adapter: the base's requests name one
        # (every adapter at scale 0), so the engine sees the change and clears that cache.
        base = Resolved(route, route.served_name, lora=(min(ids), 0.0), needs_body=True)
    out.extend((name, base) for name in route.names)
    out.append((route.served_name, base))
    out.extend((adapter, Resolved(route, adapter, adapter)) for adapter in route.lora_adapters)
    for lora in route.adapters:
        if lora.HasField("lora_id"):
            resolved = Resolved(route, route.served_name, lora.served_name, (lora.lora_id, lora.scale), needs_body=True)
        else:
            resolved = Resolved(route, lora.served_name, lora.served_name, needs_body=True)
        out.extend((name, resolved) for name in lora.names)
    return out


def _naming(route: routing_pb2.ModelRoute) -> tuple[object, ...]:
    """What of a route decides the names it answers to and what they resolve to, but its identity."""
    return (
        tuple(route.names),
        route.served_name,
        tuple(route.lora_adapters),
        tuple((tuple(a.names), a.served_name, a.HasField("lora_id"), a.lora_id, a.scale) for a in route.adapters),
    )


class RouteTable:
    """Every client-visible name -> its model's route.

    Built whole from the first route set; after that `updated` makes the next table from only the
    routes that changed: a route whose names stayed the same (a replica ready, a load reading)
    replaces its own entries, and only a change of names rebuilds the name index.
    """

    def __init__(self, routes: Iterable[routing_pb2.ModelRoute] = ()) -> None:
        self.routes: dict[str, routing_pb2.ModelRoute] = {}
        self._by_name: dict[str, Resolved] = {}
        for route in routes:
            self.routes[route.key] = route
            for name, resolved in _resolutions(route):
                self._by_name.setdefault(name, resolved)

    def updated(self, changed: Iterable[routing_pb2.ModelRoute], removed: Iterable[str] = ()) -> RouteTable:
        """The table with `changed` routes put in (by key) and the `removed` keys taken out; also
        whether any client-visible name changed (`names_changed` on the new table)."""
        routes = dict(self.routes)
        renamed = False
        for key in removed:
            if routes.pop(key, None) is not None:
                renamed = True
        changed = list(changed)
        for route in changed:
            old = routes.get(route.key)
            routes[route.key] = route
            if old is None or _naming(old) != _naming(route):
                renamed = True
        if renamed:
            table = RouteTable(routes.values())
        else:
            table = RouteTable()
            table.routes = routes
            table._by_name = dict(self._by_name)
            for route in changed:
                for name, resolved in _resolutions(route):
                    # Where another route held the name first, it keeps it.
                    if table._by_name[name].route.key == route.key:
                        table._by_name[name] = resolved
        table.names_changed = renamed
        return table

    #: Whether the last `updated` changed which names exist or what they resolve to.
    names_changed = True

    def resolve(self, name: str) -> Resolved | None:
        return self._by_name.get(name)

    def listing(self, include: Callable[[routing_pb2.ModelRoute], bool] | None = None) -> list[dict[str, Any]]:
        """OpenAI `/v1/models` data: every served name and alias, adapters with their parent.

        `include`: only the names of the routes it accepts (a scoped API key's models).
        """
        return [
            _model_object(name, resolved)
            for name, resolved in sorted(self._by_name.items())
            if include is None or include(resolved.route)
        ]

    def model_object(self, name: str) -> dict[str, Any] | None:
        """OpenAI `/v1/models/{name}`: the listing's entry for one name, None when no model has it."""
        resolved = self._by_name.get(name)
        return None if resolved is None else _model_object(name, resolved)


def _model_object(name: str, resolved: Resolved) -> dict[str, Any]:
    route = resolved.route
    entry: dict[str, Any] = {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "wakegate",
        "root": route.served_name,
    }
    if resolved.adapter is not None:
        entry["parent"] = route.served_name
    return entry
