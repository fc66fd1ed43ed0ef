"""From a source to a local path an engine can read: the one entry point of model delivery.

    resolved = await resolve("oci://127.0.0.1:5000/models/tiny:v1", cache, access=access, progress=sink)
    try:
        start_engine(resolved.model_path)          # a file (the only weight file) or the directory
    finally:
        resolved.release()                         # the lease: the entry may be evicted again

What `resolve` does per scheme:
- `file://`: checks the path exists and returns it; nothing is copied or leased.
- `pvc://`: the claim's mount under `access.pvc_root` (a pod mounts it there); without one it is
  an error on this machine.
- `oci://`, `hf://`: a cache entry, pulled if missing. A digest-pinned OCI source, a Hub commit,
  or (with the default `Policy.IF_NOT_PRESENT`) a tag or branch resolved before, is served from
  the cache without any network request. A ready entry is checked first (`Verify`); a corrupt
  one is reported (`Phase.CORRUPT`, a warning), removed and fetched again. Concurrent resolutions
  of one digest, in any process, share one download (a file lock), and the lease taken before
  the check keeps the entry from eviction until `release()`.

Failures are `DeliveryError`s with a `reason` (`unreachable`, `unauthorized`, `not_found`,
`digest_mismatch`, `cache_full`, `bad_source`, `bad_artifact`, `hub_error`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from wakegate.control.delivery import hub, media
from wakegate.control.delivery.cache import FILES, Cache, Lease
from wakegate.control.delivery.digests import Digester
from wakegate.control.delivery.errors import DeliveryError, ManifestError, SourceError
from wakegate.control.delivery.index import EntryRecord, FileRecord, dirname, primary_file
from wakegate.control.delivery.progress import Phase, Progress, ProgressSink, Tracker, ignore
from wakegate.control.delivery.registry import RegistryClient, RegistrySettings
from wakegate.control.delivery.sources import (
    FileSource,
    HfSource,
    OciSource,
    PvcSource,
    Source,
    parse_source,
    safe_relative,
)

log = logging.getLogger("wakegate.delivery")


class Policy(StrEnum):
    IF_NOT_PRESENT = "if-not-present"
    """A tag or branch resolved before is used from the cache without asking the registry."""
    ALWAYS = "always"
    """Tags and branches are looked up every time (pinned digests and commits never are)."""


class Verify(StrEnum):
    BLOCKS = "blocks"
    """Every block of every file against the marker's block table (parallel reads)."""
    SIZES = "sizes"
    """File sizes only."""


@dataclass(frozen=True)
class Access:
    """Where credentials and mounts come from; one per process."""

    registry: RegistrySettings = field(default_factory=RegistrySettings)
    hf_token: str | None = field(default=None, repr=False)
    hf_endpoint: str | None = None
    """The Hub's base URL; None: $HF_ENDPOINT, else https://huggingface.co."""
    pvc_root: Path | None = None
    """Where `pvc://CLAIM` is mounted (as PVC_ROOT/CLAIM); None off a cluster."""

    @classmethod
    def from_env(cls, registry: RegistrySettings | None = None, pvc_root: Path | None = None) -> Access:
        """Hub token from `$HF_TOKEN`, else the file `$HF_TOKEN_PATH` (a mounted Secret); endpoint
        from `$HF_ENDPOINT`."""
        token = os.environ.get("HF_TOKEN") or None
        token_path = os.environ.get("HF_TOKEN_PATH")
        if token is None and token_path:
            try:
                token = Path(token_path).read_text().strip() or None
            except OSError as exc:
                raise DeliveryError(f"cannot read the Hub token file {token_path}: {exc.strerror}",
                                    "bad_config") from None
        return cls(registry or RegistrySettings(), token, os.environ.get("HF_ENDPOINT") or None, pvc_root)


@dataclass
class Resolved:
    """Weights on local disk, ready for an engine."""

    source: Source
    root: Path
    """The directory holding the model's files."""
    files: tuple[str, ...]
    primary: Path | None
    """The one weight file, for engines that take a file (None when there is no single one)."""
    record: EntryRecord | None
    """The cache entry's marker (None for file:// and pvc://)."""
    lease: Lease | None
    pulled: bool
    """Whether bytes were fetched this time."""

    @property
    def model_path(self) -> Path:
        return self.primary or self.root

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()


async def resolve(
    source: str | Source,
    cache: Cache | None,
    *,
    access: Access | None = None,
    progress: ProgressSink = ignore,
    policy: Policy = Policy.IF_NOT_PRESENT,
    verify: Verify = Verify.BLOCKS,
    base_dir: Path | None = None,
    threads: int = 4,
    clock: Callable[[], float] = time.monotonic,
) -> Resolved:
    """The local path of `source`'s weights (see the module docstring)."""
    src = parse_source(source) if isinstance(source, str) else source
    access = access or Access()
    tracker = Tracker(progress, Progress(Phase.RESOLVING, str(src)), clock())
    try:
        if isinstance(src, FileSource):
            path = Path(src.path)
            resolved = _local(src, path if path.is_absolute() else (base_dir or Path.cwd()) / path)
        elif isinstance(src, PvcSource):
            if access.pvc_root is None:
                raise SourceError(f"{src}: pvc:// sources are mounted by a cluster; this process has no claims mounted")
            resolved = _local(src, access.pvc_root / src.claim / src.path)
        else:
            if cache is None:
                raise SourceError(f"{src}: a cache directory is needed for {type(src).__name__} sources")
            resolved = await _cached(src, cache, access, tracker, policy, verify, threads, clock)
    except DeliveryError as exc:
        tracker.finish(clock(), Phase.FAILED, str(exc))
        raise
    tracker.finish(clock(), Phase.READY, str(resolved.model_path))
    return resolved


async def cached(cache: Cache, key: str) -> Resolved:
    """A ready entry by its key, leased; no check and no network. SourceError when it is absent."""
    lease = await cache.lease(key)
    record = cache.record(key)
    if record is None:
        lease.release()
        raise SourceError(f"{key} is not in the cache {cache.root}", "not_found")
    return _from_entry(parse_source(record.source), cache, record, lease, False)


def _local(src: Source, path: Path) -> Resolved:
    if path.is_file():
        return Resolved(src, path.parent, (path.name,), path, None, None, False)
    if path.is_dir():
        names = tuple(sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()))
        primary = primary_file(names)
        return Resolved(src, path, names, path / primary if primary else None, None, None, False)
    raise SourceError(f"{src}: {path} does not exist", "not_found")


def _from_entry(src: Source, cache: Cache, record: EntryRecord, lease: Lease, pulled: bool) -> Resolved:
    root = cache.files_dir(record.key)
    primary = record.primary
    return Resolved(src, root, tuple(f.path for f in record.files), root / primary if primary else None,
                    record, lease, pulled)


async def _cached(src: OciSource | HfSource, cache: Cache, access: Access, tracker: Tracker, policy: Policy,
                  verify: Verify, threads: int, clock: Callable[[], float]) -> Resolved:
    key = _known_key(src, cache, policy)
    lease: Lease | None = None
    try:
        if key is not None:
            lease = await cache.lease(key)
            record = await _checked(src, cache, key, tracker, verify, threads, clock)
            if record is not None:
                return _from_entry(src, cache, record, lease, False)
        if isinstance(src, OciSource):
            key = await _pull_oci(src, cache, access, tracker, lease, clock)
        else:
            key = await hub.pull(src, cache, access.hf_token, access.hf_endpoint, tracker, clock)
        if lease is None or lease.key != key:
            if lease is not None:
                lease.release()
            lease = await cache.lease(key)
        record = cache.record(key)
        if record is None:
            raise DeliveryError(f"{src}: cache entry {key} vanished right after its pull", "cache_error")
        return _from_entry(src, cache, record, lease, True)
    except BaseException:
        if lease is not None:
            lease.release()
        raise


def _known_key(src: OciSource | HfSource, cache: Cache, policy: Policy) -> str | None:
    """The entry key a source names without asking anyone, if it does."""
    ref = cache.read_ref(str(src))
    if isinstance(src, OciSource) and src.digest:
        return ref.key if ref else src.digest
    if isinstance(src, HfSource) and len(src.revision) == 40 and all(c in "0123456789abcdef" for c in src.revision):
        return hub.key_for(src, src.revision)
    if ref is not None and policy is Policy.IF_NOT_PRESENT:
        return ref.key
    return None


async def _checked(src: Source, cache: Cache, key: str, tracker: Tracker, verify: Verify, threads: int,
                   clock: Callable[[], float]) -> EntryRecord | None:
    """The ready entry of `key` after its check, or None (missing, or found corrupt and removed)."""
    record = cache.record(key)
    if record is None:
        return None
    tracker.phase(Phase.VERIFYING, clock(), key, total=record.size)
    problem = await asyncio.to_thread(cache.check, record, threads, verify is Verify.BLOCKS)
    if problem is None:
        tracker.set_done(record.size, clock(), force=True)
        return record
    tracker.phase(Phase.CORRUPT, clock(), f"{key}: {problem}; fetching again")
    cache.quarantine(key, str(problem))
    return None


async def _pull_oci(src: OciSource, cache: Cache, access: Access, tracker: Tracker, lease: Lease | None,
                    clock: Callable[[], float]) -> str:
    async with RegistryClient(src.registry, access.registry, clock=clock) as client:
        tracker.phase(Phase.RESOLVING, clock(), f"asking {src.registry}")
        key, manifest, body = await client.model_manifest(src.repository, src.reference)
        if src.digest is None or src.digest != key:
            cache.write_ref(str(src), key)
        if lease is not None and lease.key == key and cache.record(key) is not None:
            return key
        files = media.files_of(manifest)
        total = sum(f.layer.size for f in files)

        async with cache.filling(key, total, tracker.waiting(clock, total)) as staging:
            if staging is None:
                return key
            (staging / "manifest.json").write_bytes(body)
            if manifest.config.media_type != media.OCI_EMPTY and manifest.config.size <= 1024 * 1024:
                config = await client.blob_bytes(src.repository, manifest.config)
                (staging / "config.json").write_bytes(config)
            tracker.phase(Phase.PULLING, clock(), key, total=total)
            records: list[FileRecord] = []
            for layer_file in files:
                records.extend(await _fetch_layer(client, src, layer_file, staging, tracker))
            _check_unique(records)
            record = EntryRecord(key, str(src), sum(r.size for r in records), time.time(), tuple(records))
            cache.commit(staging, record)
        return key


async def _fetch_layer(client: RegistryClient, src: OciSource, layer_file: media.LayerFile, staging: Path,
                       tracker: Tracker) -> list[FileRecord]:
    layer = layer_file.layer
    if layer_file.unpack is media.Unpack.FILE:
        assert layer_file.path is not None
        dest = staging / FILES / layer_file.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        digests = await client.fetch_blob(src.repository, layer, dest, tracker)
        return [FileRecord.of(layer_file.path, digests)]
    blobs = staging / "blobs"
    blobs.mkdir(exist_ok=True)
    archive = blobs / dirname(layer.digest)
    await client.fetch_blob(src.repository, layer, archive, tracker)
    records = await asyncio.to_thread(unpack_tar, archive, staging / FILES, layer_file.unpack)
    archive.unlink()
    return records


def unpack_tar(archive: Path, root: Path, unpack: media.Unpack) -> list[FileRecord]:
    """Unpack a tar layer below `root`, hashing each file as it is written. Only regular files
    and directories are accepted; a member that would land outside `root` is refused."""
    records: list[FileRecord] = []
    try:
        with tarfile.open(archive, "r:gz" if unpack is media.Unpack.TAR_GZIP else "r:") as tar:
            for member in tar:
                try:
                    rel = safe_relative(member.name)
                except SourceError as exc:
                    raise ManifestError(f"tar layer {archive.name}: {exc}") from None
                target = root / rel
                if member.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                if not member.isfile():
                    raise ManifestError(f"tar layer {archive.name}: {member.name!r} is not a regular file or directory")
                target.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(member)
                assert source is not None
                digester = Digester()
                with source, open(target, "wb") as out:
                    while chunk := source.read(8 * 1024 * 1024):
                        out.write(chunk)
                        digester.update(chunk)
                    out.flush()
                    os.fsync(out.fileno())
                records.append(FileRecord.of(rel, digester.result()))
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise ManifestError(f"tar layer {archive.name} cannot be unpacked: {exc}") from None
    return records


def _check_unique(records: list[FileRecord]) -> None:
    seen: set[str] = set()
    for record in records:
        if record.path in seen:
            raise ManifestError(f"the artifact names the file {record.path!r} twice")
        seen.add(record.path)
