"""What an OCI registry publishes, as catalog entries: one per (repository, tag).

Pure: parsed manifests and config bytes in, plain values out (`listing` talks to the registry).

An entry's facts come from, in order:
- the ModelPack config (`application/vnd.cncf.model.config.v1+json`): `config.format`,
  `config.architecture`, `config.paramSize`, `config.quantization` (else `config.precision`);
- the manifest's annotations `org.cncf.model.format`, `…architecture`, `…paramSize`,
  `…quantization` (the config's field names under the ModelPack annotation prefix; a publisher
  that writes no config can say the same there);
- the weight files' names: the format from the suffix (`.gguf`, `.safetensors`), the
  quantization from a GGUF name such as `llama-7b-Q4_K_M.gguf`.
The size is the sum of the layers (what a pull fetches); the config is not counted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import PurePosixPath
from typing import Any

from wakegate.control.delivery import media
from wakegate.control.delivery.progress import human_bytes

ANNOTATION_PREFIX = "org.cncf.model."
FACTS = ("format", "architecture", "paramSize", "quantization")
#: GGUF quantization names as llama.cpp writes them in file names
_QUANT = re.compile(r"(?:^|[-_.])((?:I?Q\d(?:_[A-Z0-9]+)*)|BF16|F16|F32)(?=\.gguf$)", re.IGNORECASE)
#: annotations kept in a cluster status (the facts above, titles, and the OCI image ones)
_STATUS_ANNOTATION = re.compile(r"^(org\.cncf\.model\.|org\.opencontainers\.image\.)")
MAX_STATUS_ANNOTATIONS = 16
MAX_ANNOTATION_VALUE = 256


@dataclass(frozen=True)
class Entry:
    """One tag of one repository."""

    repository: str
    tag: str
    digest: str
    size: int
    media_type: str
    artifact_type: str | None = None
    format: str | None = None
    architecture: str | None = None
    parameters: str | None = None
    quantization: str | None = None
    annotations: Mapping[str, str] = field(default_factory=dict)

    @property
    def short_digest(self) -> str:
        algorithm, _, hexa = self.digest.partition(":")
        return f"{algorithm}:{hexa[:12]}"

    def reference(self, registry: str) -> str:
        """The source a Model names: the tag, pinned by digest."""
        return f"oci://{registry}/{self.repository}:{self.tag}@{self.digest}"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"repository": self.repository, "tag": self.tag, "digest": self.digest,
                               "size": self.size, "mediaType": self.media_type}
        if self.artifact_type:
            out["artifactType"] = self.artifact_type
        for key, value in (("format", self.format), ("architecture", self.architecture),
                           ("parameters", self.parameters), ("quantization", self.quantization)):
            if value:
                out[key] = value
        if self.annotations:
            out["annotations"] = dict(self.annotations)
        return out


def matches(repository: str, prefixes: Sequence[str]) -> bool:
    """Whether `repository` is under one of `prefixes` (a whole path segment: `models` holds
    `models/llama`, not `models2`); no prefixes: every repository."""
    if not prefixes:
        return True
    return any(repository == p.strip("/") or repository.startswith(p.strip("/") + "/") for p in prefixes)


def _config_facts(config: bytes | None) -> dict[str, str]:
    if not config:
        return {}
    try:
        doc = json.loads(config)
    except ValueError:
        return {}
    inner = doc.get("config") if isinstance(doc, dict) else None
    if not isinstance(inner, dict):
        return {}
    facts = {k: str(inner[k]) for k in FACTS if isinstance(inner.get(k), str | int | float) and inner.get(k) != ""}
    if "quantization" not in facts and isinstance(inner.get("precision"), str) and inner["precision"]:
        facts["quantization"] = inner["precision"]
    return facts


def _file_facts(layers: Iterable[media.Descriptor]) -> dict[str, str]:
    names = [PurePosixPath(layer.annotations.get(media.ANNOTATION_TITLE)
                           or layer.annotations.get(media.ANNOTATION_FILEPATH) or "").name
             for layer in layers if layer.media_type != media.OCI_EMPTY]
    weights = [n for n in names if n.lower().endswith(media.WEIGHT_SUFFIXES)]
    facts: dict[str, str] = {}
    suffixes = {PurePosixPath(n).suffix.lower().lstrip(".") for n in weights}
    if len(suffixes) == 1:
        facts["format"] = suffixes.pop()
    quants = {m.group(1).upper() for n in weights if (m := _QUANT.search(n))}
    if len(quants) == 1:
        facts["quantization"] = quants.pop()
    return facts


def describe(repository: str, tag: str, digest: str, top_media_type: str, manifest: media.Manifest,
             config: bytes | None, annotations: Mapping[str, str] | None = None) -> Entry:
    """The entry of `repository:tag`, whose tag names `digest` (an index or the manifest itself)
    and resolves to `manifest`; `config` is its config blob when it is a ModelPack config."""
    notes = dict(annotations or {})
    facts = _file_facts(manifest.layers)
    facts.update({k: notes[ANNOTATION_PREFIX + k] for k in FACTS if notes.get(ANNOTATION_PREFIX + k)})
    facts.update(_config_facts(config))
    return Entry(
        repository=repository,
        tag=tag,
        digest=digest,
        size=sum(layer.size for layer in manifest.layers),
        media_type=top_media_type,
        artifact_type=manifest.artifact_type,
        format=facts.get("format"),
        architecture=facts.get("architecture"),
        parameters=facts.get("paramSize"),
        quantization=facts.get("quantization"),
        annotations=notes,
    )


def table(entries: Sequence[Entry]) -> list[str]:
    """`wakegate catalog ls`: one aligned line per entry under a header."""
    rows = [("REPOSITORY", "TAG", "DIGEST", "SIZE", "FORMAT", "ARCH", "PARAMS", "QUANT")]
    for e in entries:
        rows.append((e.repository, e.tag, e.short_digest, human_bytes(e.size), e.format or "-",
                     e.architecture or "-", e.parameters or "-", e.quantization or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]


def model_document(name: str, source: str, backend: str = "llamacpp", min_replicas: int = 0,
                   max_replicas: int | None = None) -> dict[str, Any]:
    """A Model manifest serving `source` as `name` (what `wakegate up` and the CRD accept)."""
    scaling: dict[str, Any] = {"min": min_replicas}
    if max_replicas is not None:
        scaling["max"] = max_replicas
    return {
        "apiVersion": "wakegate.io/v1alpha1",
        "kind": "Model",
        "metadata": {"name": name},
        "spec": {"backend": backend, "source": source, "scaling": scaling},
    }


def adapter_document(name: str, source: str, base: str) -> dict[str, Any]:
    """A LoRAAdapter manifest for an adapter artifact on top of the Model `base`."""
    return {
        "apiVersion": "wakegate.io/v1alpha1",
        "kind": "LoRAAdapter",
        "metadata": {"name": name},
        "spec": {"baseModel": base, "source": source, "servedName": name},
    }


# -- ModelCatalog status (Kubernetes) ---------------------------------------------------------------

#: entries kept in a ModelCatalog's status (an object must stay well under etcd's 1.5 MiB)
MAX_STATUS_ENTRIES = 1000
REFRESH_ANNOTATION = "wakegate.io/refresh"


def status_entry(entry: Entry) -> dict[str, Any]:
    """One entry as the ModelCatalog status shows it: annotations bounded in number and length."""
    out = entry.to_json()
    out.pop("mediaType", None)
    kept = {k: v[:MAX_ANNOTATION_VALUE] for k, v in sorted(entry.annotations.items()) if _STATUS_ANNOTATION.match(k)}
    out.pop("annotations", None)
    if kept:
        out["annotations"] = dict(list(kept.items())[:MAX_STATUS_ANNOTATIONS])
    return out


@dataclass(frozen=True)
class Refreshed:
    """What one refresh of a catalog found."""

    entries: tuple[Entry, ...]
    errors: tuple[str, ...] = ()
    """One line per repository or tag that could not be read (no secrets)."""
    failure: tuple[str, str] | None = None
    """(reason, message) when the registry could not be listed at all."""


def catalog_status(result: Refreshed, previous: Mapping[str, Any], now: str, generation: int,
                   refresh_token: str | None) -> dict[str, Any]:
    """A ModelCatalog's status after a refresh at `now` (RFC 3339). A failed listing keeps the
    entries last seen and says why in the Ready condition."""
    if result.failure is not None:
        reason, message = result.failure
        entries = list(previous.get("entries") or [])
        ready = ("False", reason, message)
    else:
        entries = [status_entry(e) for e in sorted(result.entries, key=lambda e: (e.repository, e.tag))]
        message = f"{len(entries)} entries"
        if result.errors:
            message += f"; {len(result.errors)} unreadable: " + "; ".join(result.errors[:3])
        ready = ("True", "Listed", message[:1024])
    truncated = max(0, len(entries) - MAX_STATUS_ENTRIES)
    status: dict[str, Any] = {
        "entries": entries[:MAX_STATUS_ENTRIES],
        "entryCount": len(entries),
        "truncated": truncated,
        "lastRefreshTime": now,
        "observedGeneration": generation,
        "conditions": [_condition("Ready", *ready, now, previous)],
    }
    if refresh_token is not None:
        status["refreshToken"] = refresh_token
    return status


def _condition(kind: str, state: str, reason: str, message: str, now: str,
               previous: Mapping[str, Any]) -> dict[str, str]:
    """A condition whose transition time only moves when its status changes."""
    old = next((c for c in previous.get("conditions") or [] if c.get("type") == kind), None)
    since = old.get("lastTransitionTime", now) if old and old.get("status") == state else now
    return {"type": kind, "status": state, "reason": reason, "message": message, "lastTransitionTime": since}


def refresh_delay(refresh_seconds: int, last_refresh: float | None, generation: int, observed: int | None,
                  token: str | None, seen_token: str | None, now: float) -> float:
    """Seconds until a catalog should be listed again (0: now). Now when it was never listed,
    its spec changed (generation), or its refresh annotation changed; else when the interval
    since the last refresh is up."""
    if last_refresh is None or observed != generation or (token is not None and token != seen_token):
        return 0.0
    return max(0.0, last_refresh + refresh_seconds - now)


def parse_time(text: str | None) -> float | None:
    """Epoch seconds of an RFC 3339 time as the operator writes it (`…Z`); None when unreadable."""
    if not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
