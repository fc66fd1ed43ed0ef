"""The cache's records and decisions: the readiness marker of an entry, and which entries to evict.

Pure: plain values in and out; `control/delivery/cache.py` does the file system work.

An entry is keyed by a digest: the manifest digest of an OCI artifact, or for a Hub snapshot the
SHA-256 of `hf://REPO@COMMIT[/PATH]` (a commit is immutable, so the key names fixed bytes). Its
readiness marker (`entry.json`) records the source it came from, the key, its total size, when it
was made, and every file with its size, whole-file digest and block table.

Eviction is least recently used within a byte budget, and never picks an entry in use.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from wakegate.control.delivery.digests import BLOCK_SIZE, FileDigests
from wakegate.control.delivery.errors import MarkerError, SourceError
from wakegate.control.delivery.media import WEIGHT_SUFFIXES
from wakegate.control.delivery.sources import HfSource, parse_digest, safe_relative

MARKER_VERSION = 1


def dirname(key: str) -> str:
    """The directory name of an entry: `sha256:HEX` becomes `sha256-HEX`."""
    algorithm, _, hexdigest = parse_digest(key).partition(":")
    return f"{algorithm}-{hexdigest}"


def key_of_dirname(name: str) -> str | None:
    """The key a directory name stands for, or None for anything else."""
    algorithm, _, hexdigest = name.partition("-")
    try:
        return parse_digest(f"{algorithm}:{hexdigest}")
    except SourceError:
        return None


def hf_key(source: HfSource, commit: str) -> str:
    """The key of a Hub snapshot: a digest of the repository, the commit and the file filter."""
    pinned = HfSource(source.repo, commit, source.path)
    return "sha256:" + hashlib.sha256(str(pinned).encode()).hexdigest()


def ref_name(source: str) -> str:
    """The file name the last resolution of a movable reference (a tag, a branch) is kept under."""
    return hashlib.sha256(source.encode()).hexdigest()[:32] + ".json"


@dataclass(frozen=True)
class FileRecord:
    path: str
    size: int
    digest: str
    blocks: tuple[str, ...]
    block_size: int = BLOCK_SIZE

    @classmethod
    def of(cls, path: PurePosixPath, digests: FileDigests) -> FileRecord:
        return cls(str(path), digests.size, digests.digest, digests.blocks, digests.block_size)


@dataclass(frozen=True)
class EntryRecord:
    """The readiness marker: an entry exists for users only when this is written and valid."""

    key: str
    source: str
    size: int
    created: float
    """Unix time the entry was verified and made ready."""
    files: tuple[FileRecord, ...]

    @property
    def primary(self) -> str | None:
        """The file an engine that takes one file loads: the only weight file, or the first shard
        of a split GGUF; None when there is no single choice (engines take the directory)."""
        return primary_file([f.path for f in self.files])

    def to_json(self) -> bytes:
        doc = {
            "version": MARKER_VERSION,
            "key": self.key,
            "source": self.source,
            "size": self.size,
            "created": self.created,
            "files": [
                {"path": f.path, "size": f.size, "digest": f.digest, "blockSize": f.block_size,
                 "blocks": list(f.blocks)}
                for f in self.files
            ],
        }
        return json.dumps(doc, indent=1).encode()

    @classmethod
    def from_json(cls, body: bytes, expected_key: str) -> EntryRecord:
        try:
            doc = json.loads(body)
            if doc.get("version") != MARKER_VERSION:
                raise MarkerError(f"marker version {doc.get('version')!r} is not {MARKER_VERSION}")
            files = tuple(
                FileRecord(str(safe_relative(f["path"])), int(f["size"]), parse_digest(f["digest"]),
                           tuple(str(b) for b in f["blocks"]), int(f["blockSize"]))
                for f in doc["files"]
            )
            record = cls(parse_digest(doc["key"]), str(doc["source"]), int(doc["size"]), float(doc["created"]), files)
        except MarkerError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise MarkerError(f"marker is unreadable: {exc!r}") from None
        if record.key != expected_key:
            raise MarkerError(f"marker names {record.key}, not {expected_key}")
        if record.size != sum(f.size for f in record.files):
            raise MarkerError("marker's size is not the sum of its files")
        return record


def primary_file(paths: Sequence[str]) -> str | None:
    weights = sorted(p for p in paths if p.lower().endswith(WEIGHT_SUFFIXES))
    if len(weights) == 1:
        return weights[0]
    ggufs = [p for p in weights if p.lower().endswith(".gguf")]
    if ggufs and len(ggufs) == len(weights) and "-00001-of-" in ggufs[0]:
        return ggufs[0]
    return None


@dataclass(frozen=True)
class RefRecord:
    """What a movable reference (tag, branch) last resolved to."""

    source: str
    key: str
    resolved: float

    def to_json(self) -> bytes:
        return json.dumps({"source": self.source, "key": self.key, "resolved": self.resolved}).encode()

    @classmethod
    def from_json(cls, body: bytes) -> RefRecord | None:
        try:
            doc: Mapping[str, Any] = json.loads(body)
            return cls(str(doc["source"]), parse_digest(doc["key"]), float(doc["resolved"]))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


@dataclass(frozen=True)
class EntryUse:
    """What eviction knows of an entry."""

    key: str
    size: int
    last_used: float
    in_use: bool


@dataclass(frozen=True)
class EvictionPlan:
    evict: tuple[str, ...]
    """Keys to remove, least recently used first."""
    fits: bool
    """Whether `incoming` bytes fit in the budget once those are gone."""
    in_use_bytes: int
    """Bytes held by entries in use (never evicted)."""


def plan_eviction(entries: Iterable[EntryUse], budget: int, incoming: int = 0,
                  keep: frozenset[str] = frozenset()) -> EvictionPlan:
    """The least recently used entries to remove so that the cache plus `incoming` bytes fits in
    `budget`. Entries in use and those in `keep` are never chosen; if removing every other entry is
    not enough, nothing is removed and `fits` is False (the caller says why and does not pull)."""
    entries = list(entries)
    total = sum(e.size for e in entries) + incoming
    in_use = sum(e.size for e in entries if e.in_use)
    if total <= budget:
        return EvictionPlan((), True, in_use)
    candidates = sorted((e for e in entries if not e.in_use and e.key not in keep), key=lambda e: (e.last_used, e.key))
    chosen: list[str] = []
    for entry in candidates:
        if total <= budget:
            break
        chosen.append(entry.key)
        total -= entry.size
    if total > budget:
        return EvictionPlan((), False, in_use)
    return EvictionPlan(tuple(chosen), True, in_use)
