"""Publish a model file (a GGUF) or a directory as a ModelPack OCI artifact (`media` says how).

Every file becomes one uncompressed layer named by its path relative to what was pushed, so
`oras pull` writes the same tree back, and `resolve()` pulls it into the cache. Blobs the
registry already has are not sent again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path, PurePosixPath

from wakegate.control.delivery import media
from wakegate.control.delivery.digests import Digester, digest_of
from wakegate.control.delivery.errors import DeliveryError, SourceError
from wakegate.control.delivery.progress import Phase, Progress, ProgressSink, Tracker, ignore
from wakegate.control.delivery.registry import RegistryClient, RegistrySettings
from wakegate.control.delivery.sources import OciSource, parse_source

READ = 4 * 1024 * 1024


def files_to_push(path: Path) -> list[tuple[PurePosixPath, Path]]:
    """(name in the artifact, file on disk): the file itself, or every regular file under a
    directory (symbolic links followed), in name order."""
    if path.is_file():
        return [(PurePosixPath(path.name), path)]
    if not path.is_dir():
        raise SourceError(f"{path} is neither a file nor a directory", "not_found")
    found = sorted((PurePosixPath(p.relative_to(path).as_posix()), p) for p in path.rglob("*") if p.is_file())
    if not found:
        raise SourceError(f"{path} holds no files", "not_found")
    return found


def _digest_file(path: Path) -> tuple[str, int]:
    digester = Digester()
    with open(path, "rb") as stream:
        while chunk := stream.read(READ):
            digester.update(chunk)
    result = digester.result()
    return result.digest, result.size


async def push(path: Path, target: str | OciSource, *, settings: RegistrySettings | None = None,
               progress: ProgressSink = ignore, name: str | None = None,
               clock: Callable[[], float] = time.monotonic) -> str:
    """Push `path` to `target` (`oci://REGISTRY/REPO:TAG`); returns the manifest digest."""
    dest = parse_source(target) if isinstance(target, str) else target
    if not isinstance(dest, OciSource):
        raise SourceError(f"{dest}: push needs an oci:// target")
    files = files_to_push(path)
    default_name = path.stem if len(files) == 1 and files[0][1] == path else path.name
    total = sum(p.stat().st_size for _, p in files)
    tracker = Tracker(progress, Progress(Phase.PUSHING, str(dest), total=total, detail="hashing"), clock())
    try:
        layers = []
        for rel, local in files:
            digest, size = await asyncio.to_thread(_digest_file, local)
            tracker.advance(size, clock())
            layers.append(media.layer_for(rel, digest, size))
        config = media.model_config(layers, name or default_name)
        config_desc = media.Descriptor(media.MODEL_CONFIG, digest_of(config), len(config))
        manifest = media.image_manifest(config_desc, layers)
        manifest_digest = digest_of(manifest)
        if dest.digest and dest.digest != manifest_digest:
            raise SourceError(f"{dest}: the artifact's digest would be {manifest_digest}, not the one named")
        tracker.phase(Phase.PUSHING, clock(), "uploading", total=total)
        async with RegistryClient(dest.registry, settings or RegistrySettings(), clock=clock) as client:
            for (_, local), layer in zip(files, layers, strict=True):
                before = tracker.current.done

                def chunks(local: Path = local, before: int = before) -> AsyncIterator[bytes]:
                    tracker.set_done(before, clock())
                    return _read_chunks(local, tracker, clock)

                await client.push_blob(dest.repository, layer.digest, layer.size, chunks)
                tracker.set_done(before + layer.size, clock())
            await client.push_blob(dest.repository, config_desc.digest, config_desc.size, lambda: _one(config))
            await client.push_manifest(dest.repository, dest.tag or manifest_digest, manifest, media.OCI_MANIFEST)
    except DeliveryError as exc:
        tracker.finish(clock(), Phase.FAILED, str(exc))
        raise
    tracker.finish(clock(), Phase.READY, manifest_digest)
    return manifest_digest


async def _read_chunks(path: Path, tracker: Tracker, clock: Callable[[], float]) -> AsyncIterator[bytes]:
    with open(path, "rb") as stream:
        while chunk := await asyncio.to_thread(stream.read, READ):
            tracker.advance(len(chunk), clock())
            yield chunk


async def _one(body: bytes) -> AsyncIterator[bytes]:
    yield body
