"""A typed wire codec for the feeder's plain-data classes, and length-prefixed frames to carry it.

`wakegate up` hands its feeder process `RoutedModel`s and `GatewaySettings`. Both are frozen
dataclasses of strings, numbers, tuples and nested dataclasses; `to_wire` turns one into JSON
values and `from_wire` rebuilds it from the class's own type hints, so every field (a tuple of
tuples, a nested adapter, a field added next month) round-trips without a converter written
for it, and a value of the wrong shape is a `ValueError` naming the field, never a half-built
object.

Frames are a 4-byte big-endian length and that many bytes of UTF-8 JSON: no line length to
outgrow, and a reader that knows where each message ends before parsing it. `MAX_FRAME` only
bounds a corrupt length prefix; real messages (a thousand models are about 1 MB) are far below it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import struct
import types
import typing
from collections.abc import Mapping
from functools import cache
from typing import Any, TypeVar

_T = TypeVar("_T")

#: Largest frame a reader accepts: a bound on a corrupt or hostile length prefix, not on the data.
MAX_FRAME = 1 << 30
_HEADER = struct.Struct(">I")


class FrameError(ValueError):
    """A frame that cannot be read: a length past `MAX_FRAME`, or a payload that is not a JSON object."""


def to_wire(value: Any) -> Any:
    """JSON values for a dataclass instance (recursively); tuples become lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_wire(getattr(value, f.name)) for f in _fields(type(value))}
    if isinstance(value, tuple | list):
        return [to_wire(v) for v in value]
    return value


def from_wire(cls: type[_T], data: Any) -> _T:
    """An instance of the dataclass `cls` from `to_wire`'s output; fields left out keep their defaults."""
    result: _T = _decode(cls, data, cls.__name__)
    return result


@cache
def _fields(cls: type) -> tuple[dataclasses.Field[Any], ...]:
    return dataclasses.fields(cls)


@cache
def _hints(cls: type) -> Mapping[str, Any]:
    return typing.get_type_hints(cls)


def _decode(hint: Any, data: Any, where: str) -> Any:
    if hint is Any:
        return data
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
        hints = _hints(hint)
        unknown = data.keys() - hints.keys()
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        return hint(**{name: _decode(hints[name], value, f"{where}.{name}") for name, value in data.items()})
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is types.UnionType or origin is typing.Union:
        if data is None and type(None) in args:
            return None
        for arg in args:
            if arg is not type(None):
                return _decode(arg, data, where)
    if origin is tuple:
        if not isinstance(data, list):
            raise ValueError(f"{where}: expected a list, got {type(data).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(data))
        if len(args) != len(data):
            raise ValueError(f"{where}: expected {len(args)} items, got {len(data)}")
        return tuple(_decode(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, data, strict=True)))
    if origin is dict:
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
        return data
    if hint is float:
        if isinstance(data, int | float) and not isinstance(data, bool):
            return float(data)
    elif hint in (int, str, bool):
        if type(data) is hint:
            return data
    else:
        raise ValueError(f"{where}: no wire form for {hint!r}")
    raise ValueError(f"{where}: expected {hint.__name__}, got {type(data).__name__}")


def frame(message: Mapping[str, Any]) -> bytes:
    """One message as a frame: its length, then its JSON."""
    payload = json.dumps(message, separators=(",", ":")).encode()
    if len(payload) > MAX_FRAME:
        raise FrameError(f"message of {len(payload)} bytes is larger than a frame may be ({MAX_FRAME})")
    return _HEADER.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """The next message, or None at a clean end of stream (EOF between frames).

    Raises `FrameError` for a length past `MAX_FRAME` or a payload that is not a JSON object,
    and `asyncio.IncompleteReadError` for a stream cut inside a frame.
    """
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME:
        raise FrameError(f"frame of {size} bytes announced; at most {MAX_FRAME}")
    payload = await reader.readexactly(size)
    try:
        message = json.loads(payload)
    except ValueError as exc:
        raise FrameError(f"frame is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise FrameError(f"frame holds a {type(message).__name__}, not an object")
    return message
