"""Reading manifest files (`wakegate up`'s models file): YAML documents into typed Models and
LoRAAdapters, with errors that name the document and the field.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from wakegate.control.schema import LoRAAdapter, Model


class ManifestError(ValueError):
    """A manifest file that cannot be used; the message names the document and field."""


@dataclass(frozen=True)
class _Doc:
    index: int
    body: Any


def _docs(text: str) -> Iterable[_Doc]:
    try:
        for index, body in enumerate(yaml.safe_load_all(text), start=1):
            if body is not None:
                yield _Doc(index, body)
    except yaml.YAMLError as exc:
        raise ManifestError(f"not valid YAML: {exc}") from None


_T = TypeVar("_T", bound=BaseModel)


def _validated(typed: type[_T], body: Mapping[str, Any], where: str) -> _T:
    """`body` as a `typed` object, or a ManifestError naming `where` and every bad field."""
    try:
        return typed.model_validate(body)
    except ValidationError as exc:
        problems = "; ".join(f"{_field_path(err['loc']) or '(document)'}: {err['msg']}" for err in exc.errors())
        raise ManifestError(f"{where}: {problems}") from None


def _field_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


@dataclass(frozen=True)
class Manifest:
    """The documents of one manifest: Models (each carrying its adapters) and LoRAAdapters."""

    models: list[Model]
    adapters: list[LoRAAdapter]


_KINDS: dict[str, type[Model] | type[LoRAAdapter]] = {"Model": Model, "LoRAAdapter": LoRAAdapter}


def parse_manifest(text: str, source: str = "<input>") -> Manifest:
    """Parse YAML documents of `kind: Model` and `kind: LoRAAdapter`; raise ManifestError naming
    document and field. Every adapter's base must be a Model of the manifest, and no two objects
    may answer to the same name."""
    models: list[Model] = []
    adapters: list[tuple[str, LoRAAdapter]] = []
    seen_names: dict[str, tuple[str, str]] = {}  # client name -> (owner's identity, how to name it)
    for doc in _docs(text):
        where = f"{source}: document {doc.index}"
        if not isinstance(doc.body, dict):
            raise ManifestError(f"{where}: expected a mapping with apiVersion, kind, metadata, spec")
        kind = doc.body.get("kind")
        typed = _KINDS.get(kind) if isinstance(kind, str) else None
        if typed is None:
            raise ManifestError(f"{where}: kind must be one of {', '.join(_KINDS)}, not {kind!r}")
        name = doc.body.get("metadata", {}).get("name") if isinstance(doc.body.get("metadata"), dict) else None
        if name:
            where += f" ({kind} {name!r})"
        parsed = _validated(typed, doc.body, where)
        if isinstance(parsed, Model):
            owner = (parsed.key, f"Model {parsed.key!r}")
            names = parsed.client_names + parsed.spec.loraAdapters
            models.append(parsed)
        else:
            owner = (f"#{doc.index}", f"LoRAAdapter {parsed.name!r}")
            names = parsed.client_names
            adapters.append((where, parsed))
        for client_name in names:
            seen = seen_names.get(client_name)
            if seen is not None and seen[0] != owner[0]:
                raise ManifestError(f"{where}: name {client_name!r} is already used by {seen[1]}")
            seen_names[client_name] = owner
    if not models:
        raise ManifestError(f"{source}: no Model documents found")
    by_name = {model.name: model for model in models}
    for where, adapter in adapters:
        if adapter.spec.baseModel not in by_name:
            raise ManifestError(f"{where}: spec.baseModel: no Model {adapter.spec.baseModel!r} in {source}")
    served = []
    for model in models:
        own = [adapter for _, adapter in adapters if adapter.spec.baseModel == model.name]
        if own:
            _check_adapters(model, len(own), source)
        served.append(model.with_adapters(own) if own else model)
    return Manifest(served, [adapter for _, adapter in adapters])


def _check_adapters(model: Model, count: int, source: str) -> None:
    from wakegate.control.backends import BACKENDS

    backend = BACKENDS[model.spec.backend]
    if not backend.serves_adapters:
        raise ManifestError(f"{source}: Model {model.name!r}: backend {backend.name} cannot load LoRAAdapters")
    cap = model.spec.adapters.maxAdapters
    if backend.lora_arg and count > cap:
        # Every replica holds all of its base's adapters (llama.cpp's server loads them only at start);
        # engines that load adapters at run time swap them in and out instead.
        raise ManifestError(
            f"{source}: Model {model.name!r} has {count} LoRAAdapters, more than spec.adapters.maxAdapters ({cap}); "
            "each replica holds every adapter of its base"
        )


def parse_models(text: str, source: str = "<input>") -> list[Model]:
    """The Models of a manifest (:func:`parse_manifest`), each carrying its LoRAAdapters."""
    return parse_manifest(text, source).models
