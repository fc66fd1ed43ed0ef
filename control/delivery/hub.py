"""`hf://` sources: a Hugging Face Hub snapshot into the cache, through `huggingface_hub`.

The branch or tag is resolved to a commit (`HfApi.model_info`, which also lists every file with
its size, and for LFS files their SHA-256), the files are downloaded into the entry's staging
directory (`hf_hub_download` per file), and each is checked against that listing (size; SHA-256
for LFS files, the git blob id for the others) before the entry is committed. The endpoint is
`$HF_ENDPOINT` (or the caller's), the token `$HF_TOKEN` or a Secret file (`Access.from_env`);
neither the token nor a header ever reaches a log line or an error.

No Hub is reachable from this project's machines, so this path is tested against a local HTTP
server that answers the requests `huggingface_hub` makes (tests/control/delivery/test_hub.py),
not against huggingface.co.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from wakegate.control.delivery.cache import FILES, Cache, tree_size
from wakegate.control.delivery.digests import Digester
from wakegate.control.delivery.errors import DigestMismatch, HubError
from wakegate.control.delivery.index import EntryRecord, FileRecord, hf_key
from wakegate.control.delivery.progress import Phase, Tracker
from wakegate.control.delivery.sources import HfSource, safe_relative

log = logging.getLogger("wakegate.delivery")

DEFAULT_ENDPOINT = "https://huggingface.co"
#: seconds between progress looks at the download directory
WATCH_INTERVAL = 0.25


@dataclass(frozen=True)
class HubFile:
    path: str
    size: int | None
    sha256: str | None
    """Hex SHA-256 of an LFS file."""
    blob_id: str | None
    """Git blob id (SHA-1) of a file kept in git."""


def key_for(src: HfSource, commit: str) -> str:
    return hf_key(src, commit)


def _endpoint(endpoint: str | None) -> str:
    return (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def _matches(path: str, pattern: str | None) -> bool:
    if pattern is None:
        return True
    return PurePosixPath(path).match(pattern) or path == pattern or path.startswith(pattern.rstrip("/") + "/")


def _hub_error(src: HfSource, endpoint: str, exc: Exception) -> HubError:
    from huggingface_hub import errors

    name = type(exc).__name__
    if isinstance(exc, errors.RepositoryNotFoundError | errors.RevisionNotFoundError | errors.EntryNotFoundError):
        return HubError(f"{src}: not found on {endpoint} ({name}; private repositories need a token)", "not_found")
    if isinstance(exc, errors.HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        reason = "unauthorized" if status in (401, 403) else "hub_error"
        return HubError(f"{src}: {endpoint} answered HTTP {status} ({name})", reason)
    return HubError(f"{src}: {endpoint} is unreachable ({name})", "unreachable")


def snapshot_listing(src: HfSource, token: str | None, endpoint: str | None) -> tuple[str, list[HubFile]]:
    """(commit, files) of the revision the source names; blocking (run it in a thread)."""
    from huggingface_hub import HfApi

    base = _endpoint(endpoint)
    try:
        info = HfApi(endpoint=base, token=token or False).model_info(
            src.repo, revision=src.revision, files_metadata=True, token=token or False
        )
    except Exception as exc:  # huggingface_hub and its HTTP client raise many kinds
        raise _hub_error(src, base, exc) from None
    if not info.sha:
        raise HubError(f"{src}: {base} named no commit for revision {src.revision}")
    files = []
    for sibling in info.siblings or []:
        if not _matches(sibling.rfilename, src.path):
            continue
        lfs = sibling.lfs
        files.append(HubFile(sibling.rfilename, sibling.size, lfs.sha256 if lfs else None, sibling.blob_id))
    if not files:
        raise HubError(f"{src}: no files{' match ' + src.path if src.path else ''} at commit {info.sha}", "not_found")
    return info.sha, files


def download(src: HfSource, commit: str, files: list[HubFile], dest: Path, token: str | None,
             endpoint: str | None) -> None:
    """Download `files` at `commit` into `dest` (`hf_hub_download` per file, four at a time);
    blocking."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils.tqdm import disable_progress_bars

    disable_progress_bars()
    base = _endpoint(endpoint)

    def one(f: HubFile) -> None:
        hf_hub_download(src.repo, f.path, revision=commit, local_dir=dest, endpoint=base, token=token or False)

    try:
        with ThreadPoolExecutor(4, thread_name_prefix="hf-download") as pool:
            list(pool.map(one, files))
    except Exception as exc:
        raise _hub_error(src, base, exc) from None
    shutil.rmtree(dest / ".cache", ignore_errors=True)


def verify(dest: Path, files: list[HubFile], where: str) -> list[FileRecord]:
    """Each downloaded file against the listing; its record (digest and block table)."""
    records = []
    for f in files:
        path = dest / safe_relative(f.path)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise HubError(f"{where}: {f.path} was not downloaded") from None
        if f.size is not None and size != f.size:
            raise DigestMismatch(f"{where}: {f.path} is {size} bytes, the Hub lists {f.size}")
        digester = Digester()
        git = hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False) if f.sha256 is None else None
        with open(path, "rb") as stream:
            while chunk := stream.read(8 * 1024 * 1024):
                digester.update(chunk)
                if git is not None:
                    git.update(chunk)
        digests = digester.result()
        if f.sha256 is not None and digests.digest != f"sha256:{f.sha256}":
            raise DigestMismatch(f"{where}: {f.path} has digest {digests.digest}, the Hub lists sha256:{f.sha256}")
        if git is not None and f.blob_id and git.hexdigest() != f.blob_id:
            raise DigestMismatch(f"{where}: {f.path} has git blob id {git.hexdigest()}, the Hub lists {f.blob_id}")
        records.append(FileRecord.of(PurePosixPath(f.path), digests))
    return records


async def pull(src: HfSource, cache: Cache, token: str | None, endpoint: str | None, tracker: Tracker,
               clock: Callable[[], float]) -> str:
    """Resolve the revision, download the snapshot into the cache (once across processes), and
    return its key."""
    tracker.phase(Phase.RESOLVING, clock(), f"asking {_endpoint(endpoint)}")
    commit, files = await asyncio.to_thread(snapshot_listing, src, token, endpoint)
    key = hf_key(src, commit)
    if len(src.revision) != 40 or src.revision != commit:
        cache.write_ref(str(src), key)
    if cache.record(key) is not None:
        return key
    total = sum(f.size or 0 for f in files)

    async with cache.filling(key, total, tracker.waiting(clock, total)) as staging:
        if staging is None:
            return key
        root = staging / FILES
        tracker.phase(Phase.PULLING, clock(), f"{src.repo}@{commit[:12]}", total=total)
        task = asyncio.create_task(asyncio.to_thread(download, src, commit, files, root, token, endpoint))
        while not task.done():
            await asyncio.wait({task}, timeout=WATCH_INTERVAL)
            tracker.set_done(tree_size(root), clock())
        await task
        tracker.phase(Phase.VERIFYING, clock(), "checking files against the Hub's listing", total=total)
        records = await asyncio.to_thread(verify, root, files, str(src))
        pinned = HfSource(src.repo, commit, src.path)
        record = EntryRecord(key, str(pinned), sum(r.size for r in records), time.time(), tuple(records))
        cache.commit(staging, record)
    return key
