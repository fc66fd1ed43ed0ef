"""OCI manifests of model artifacts: what a pulled manifest means as files, and what a push writes.

Pure: JSON bytes in, plain values out. The registry client moves the bytes.

Pushing follows the CNCF ModelPack model-spec (v1, `application/vnd.cncf.model.*`) with ORAS's
file naming: an OCI image manifest whose `artifactType` is the ModelPack model manifest, a
ModelPack config, and one uncompressed layer per file (`…weight.v1.raw` for weights,
`…weight.config.v1.raw` for tokenizer and configuration files, `…doc.v1.raw` for documents),
each annotated with `org.opencontainers.image.title` (the name `oras pull` writes) and
`org.cncf.model.filepath`. The same bytes give the same manifest digest: nothing time-dependent
goes into the config or the annotations.

Pulling reads what ORAS, KitOps and ModelPack tools publish:
- a layer with a title (or ModelPack filepath) annotation that is not an archive becomes that
  file, byte for byte (so its layer digest is the file's digest);
- a layer whose media type is a tar (`…tar`, `…tar+gzip`; ORAS directories, KitOps, ModelPack
  tar layers) is unpacked into the model's root; `+zstd` layers are refused by name;
- an index (OCI index or Docker manifest list) is narrowed to one manifest: the only one, the
  one whose artifact type is a model, or the one for this platform (linux/amd64 by default).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import PurePosixPath
from typing import Any

from wakegate.control.delivery.errors import ManifestError, SourceError
from wakegate.control.delivery.sources import parse_digest, safe_relative

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
INDEX_TYPES = (OCI_INDEX, DOCKER_MANIFEST_LIST)
#: what a client asks for when it fetches a manifest by tag or digest
ACCEPT = ", ".join((*MANIFEST_TYPES, *INDEX_TYPES))

OCI_EMPTY = "application/vnd.oci.empty.v1+json"

MODEL_ARTIFACT = "application/vnd.cncf.model.manifest.v1+json"
MODEL_CONFIG = "application/vnd.cncf.model.config.v1+json"
WEIGHT_RAW = "application/vnd.cncf.model.weight.v1.raw"
WEIGHT_CONFIG_RAW = "application/vnd.cncf.model.weight.config.v1.raw"
DOC_RAW = "application/vnd.cncf.model.doc.v1.raw"

ANNOTATION_TITLE = "org.opencontainers.image.title"
ANNOTATION_FILEPATH = "org.cncf.model.filepath"

#: file suffixes pushed as weights; other files by name below, everything else as weight config
WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth", ".onnx", ".ggml", ".nemo", ".h5", ".npz")
DOC_NAMES = ("readme", "license", "licence", "notice", "model_card", "modelcard")
DOC_SUFFIXES = (".md", ".txt", ".rst")

#: the biggest manifest a client reads (distribution's own limit is 4 MiB)
MAX_MANIFEST_BYTES = 4 * 1024 * 1024


class Unpack(StrEnum):
    """How a layer becomes files."""

    FILE = "file"
    TAR = "tar"
    TAR_GZIP = "tar+gzip"


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    annotations: Mapping[str, str] = field(default_factory=dict)
    artifact_type: str | None = None
    platform: Mapping[str, str] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.artifact_type:
            out["artifactType"] = self.artifact_type
        if self.annotations:
            out["annotations"] = dict(self.annotations)
        return out


@dataclass(frozen=True)
class LayerFile:
    """One layer and how it lands under the model's root."""

    layer: Descriptor
    unpack: Unpack
    path: PurePosixPath | None
    """The file a FILE layer becomes; for archives, the title if any (informational)."""


@dataclass(frozen=True)
class Manifest:
    media_type: str
    artifact_type: str | None
    config: Descriptor
    layers: tuple[Descriptor, ...]


@dataclass(frozen=True)
class Index:
    media_type: str
    manifests: tuple[Descriptor, ...]


def _descriptor(raw: Any, where: str) -> Descriptor:
    if not isinstance(raw, dict):
        raise ManifestError(f"{where} is not an object")
    try:
        media_type, digest, size = raw["mediaType"], raw["digest"], raw["size"]
    except KeyError as exc:
        raise ManifestError(f"{where} has no {exc.args[0]}") from None
    if not isinstance(media_type, str) or not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ManifestError(f"{where} has a bad mediaType or size")
    try:
        parse_digest(str(digest))
    except SourceError as exc:
        raise ManifestError(f"{where}: {exc}") from None
    annotations = raw.get("annotations") or {}
    if not isinstance(annotations, dict) or not all(isinstance(v, str) for v in annotations.values()):
        raise ManifestError(f"{where} has annotations that are not strings")
    platform = raw.get("platform")
    return Descriptor(
        media_type,
        digest,
        size,
        annotations,
        raw.get("artifactType") if isinstance(raw.get("artifactType"), str) else None,
        {k: str(v) for k, v in platform.items() if isinstance(v, str)} if isinstance(platform, dict) else None,
    )


def parse(body: bytes, content_type: str | None = None) -> Manifest | Index:
    """A manifest or an index from its bytes; the media type comes from the document, else the
    response's Content-Type."""
    if len(body) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest is {len(body)} bytes, more than {MAX_MANIFEST_BYTES}")
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise ManifestError(f"manifest is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("schemaVersion") != 2:
        raise ManifestError("not a schemaVersion 2 manifest (Docker schema 1 is not supported)")
    media_type = doc.get("mediaType") or (content_type or "").split(";")[0].strip()
    if not media_type:
        media_type = OCI_INDEX if "manifests" in doc else OCI_MANIFEST
    if media_type in INDEX_TYPES:
        entries = doc.get("manifests")
        if not isinstance(entries, list):
            raise ManifestError("index has no manifests list")
        return Index(media_type, tuple(_descriptor(m, f"index entry {i}") for i, m in enumerate(entries)))
    if media_type not in MANIFEST_TYPES:
        raise ManifestError(f"unsupported manifest media type {media_type!r}")
    layers = doc.get("layers")
    if not isinstance(layers, list):
        raise ManifestError("manifest has no layers list")
    artifact_type = doc.get("artifactType")
    return Manifest(
        media_type,
        artifact_type if isinstance(artifact_type, str) else None,
        _descriptor(doc.get("config"), "config"),
        tuple(_descriptor(layer, f"layer {i}") for i, layer in enumerate(layers)),
    )


def choose(index: Index, os: str = "linux", architecture: str = "amd64") -> Descriptor:
    """The one manifest of an index a model is pulled from (see the module docstring)."""
    candidates = [m for m in index.manifests if m.media_type in (*MANIFEST_TYPES, *INDEX_TYPES)]
    if len(candidates) == 1:
        return candidates[0]
    models = [m for m in candidates if m.artifact_type == MODEL_ARTIFACT]
    if len(models) == 1:
        return models[0]
    for entry in candidates:
        platform = entry.platform or {}
        if platform.get("os") == os and platform.get("architecture") == architecture:
            return entry
    listed = ", ".join(f"{m.digest[:19]}… {dict(m.platform or {})}" for m in candidates) or "none"
    raise ManifestError(f"index lists no single model manifest and none for {os}/{architecture}: {listed}")


def _unpack(media_type: str) -> Unpack | None:
    base = media_type.split(";")[0].strip()
    if base.endswith("+zstd"):
        raise ManifestError(f"layer media type {base!r} is zstd-compressed, which is not supported")
    if base.endswith(("tar+gzip", ".tgz")):
        return Unpack.TAR_GZIP
    if base.endswith("tar"):
        return Unpack.TAR
    return None


def files_of(manifest: Manifest) -> list[LayerFile]:
    """How each layer lands under the model's root; refuses layers with no usable file name, a
    name that would escape the root, or two layers claiming one file."""
    out: list[LayerFile] = []
    seen: set[PurePosixPath] = set()
    for i, layer in enumerate(manifest.layers):
        if layer.media_type == OCI_EMPTY:
            continue
        name = layer.annotations.get(ANNOTATION_TITLE) or layer.annotations.get(ANNOTATION_FILEPATH)
        path = None
        if name:
            try:
                path = safe_relative(name)
            except SourceError as exc:
                raise ManifestError(f"layer {i} ({layer.digest}): {exc}") from None
        unpack = _unpack(layer.media_type)
        if unpack is None:
            if path is None:
                raise ManifestError(
                    f"layer {i} ({layer.digest}, {layer.media_type}) has no file name "
                    f"({ANNOTATION_TITLE}) and is not a tar archive"
                )
            if path in seen:
                raise ManifestError(f"two layers are both named {str(path)!r}")
            seen.add(path)
            out.append(LayerFile(layer, Unpack.FILE, path))
        else:
            out.append(LayerFile(layer, unpack, path))
    if not out:
        raise ManifestError("manifest has no layers with files")
    return out


def media_type_for(path: PurePosixPath) -> str:
    """The ModelPack layer type a pushed file gets, from its name."""
    name = path.name.lower()
    if name.endswith(WEIGHT_SUFFIXES):
        return WEIGHT_RAW
    if name.startswith(DOC_NAMES) or name.endswith(DOC_SUFFIXES):
        return DOC_RAW
    return WEIGHT_CONFIG_RAW


def layer_for(path: PurePosixPath, digest: str, size: int) -> Descriptor:
    """The descriptor a pushed file gets: its media type and both file-name annotations."""
    name = str(path)
    return Descriptor(media_type_for(path), digest, size, {ANNOTATION_TITLE: name, ANNOTATION_FILEPATH: name})


def model_config(layers: Sequence[Descriptor], name: str) -> bytes:
    """The ModelPack config of a pushed model: its name, its format, and the layers' digests."""
    weights = [PurePosixPath(layer.annotations.get(ANNOTATION_TITLE, "")).suffix for layer in layers
               if layer.media_type == WEIGHT_RAW]
    formats = sorted({suffix.lstrip(".") for suffix in weights if suffix})
    config: dict[str, Any] = {"descriptor": {"name": name}, "config": {}}
    if len(formats) == 1:
        config["config"]["format"] = formats[0]
    config["modelfs"] = {"type": "layers", "diff_ids": [layer.digest for layer in layers]}
    return canonical_json(config)


def image_manifest(config: Descriptor, layers: Sequence[Descriptor],
                   annotations: Mapping[str, str] | None = None) -> bytes:
    """A ModelPack OCI image manifest over `config` and `layers`."""
    doc: dict[str, Any] = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": MODEL_ARTIFACT,
        "config": config.to_json(),
        "layers": [layer.to_json() for layer in layers],
    }
    if annotations:
        doc["annotations"] = dict(annotations)
    return canonical_json(doc)


def manifest_annotations(body: bytes) -> dict[str, str]:
    """A manifest's own `annotations` (string values only); {} when it has none."""
    try:
        doc = json.loads(body)
    except ValueError:
        return {}
    notes = doc.get("annotations") if isinstance(doc, dict) else None
    return {str(k): v for k, v in notes.items() if isinstance(v, str)} if isinstance(notes, dict) else {}


_NEXT = re.compile(r'<([^>]*)>\s*;(?:[^,]*;)?\s*rel="?next"?', re.IGNORECASE)


def next_page(link: str) -> str | None:
    """The `rel="next"` target of a listing's `Link` header (RFC 8288), if it names one."""
    match = _NEXT.search(link)
    return match.group(1) if match and match.group(1) else None


def listed_names(body: bytes, key: str, where: str) -> list[str]:
    """The names of one listing page: `{"repositories": [...]}` or `{"name": ..., "tags": [...]}`
    (`tags` may be null for a repository without any)."""
    try:
        doc = json.loads(body)
    except ValueError:
        raise ManifestError(f"{where}: the answer is not JSON") from None
    names = doc.get(key) if isinstance(doc, dict) else None
    if names is None and isinstance(doc, dict):
        return []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ManifestError(f"{where}: {key} is not a list of names")
    return names


def canonical_json(doc: Any) -> bytes:
    """Compact JSON with sorted keys: the same document always has the same digest."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
