"""Flash loading: a cached model staged into fast storage before an engine starts.

`flash_load` reads a model's files with `threads` parallel streams of large reads (`chunk_size`,
a multiple of 4 KiB) into page-aligned buffers. With a destination directory (a tmpfs such as
/dev/shm) it writes the bytes there and renames each file into place only when all of it was
read and verified; reads then bypass the page cache (`O_DIRECT`) where the file system allows
it, so the source's pages do not take memory a second time. Without a destination it only
reads, through the page cache (`POSIX_FADV_WILLNEED`), so the engine's own reads come from memory.

Verification: a file from the cache has a block table (`digests.BLOCK_SIZE` blocks, each
hashed while its whole-file digest was verified at pull time); every block is hashed as it is
read, on the thread that read it, and compared, so checking scales with the threads instead of
being bound to one core's SHA-256. A corrupt block fails the staging (`DigestMismatch` naming
the file and block) and nothing is renamed into place. Files without a block table (a
`file://` source) are copied unverified, and `Staged.verified` says so.

A destination that already holds the same entry (its `.wakegate-staged.json` names the key and
every file is there at its size) is not copied again.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import mmap
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from wakegate.control.delivery.digests import BLOCK_SIZE, block_ranges
from wakegate.control.delivery.errors import DeliveryError, DigestMismatch
from wakegate.control.delivery.index import EntryRecord
from wakegate.control.delivery.progress import Phase, Progress, ProgressSink, Tracker, human_bytes, ignore
from wakegate.control.delivery.sources import safe_relative

#: O_DIRECT needs offsets, lengths and buffers aligned to the device's logical block size;
#: 4 KiB covers every device in use
ALIGN = 4096
DEFAULT_CHUNK = 4 * 1024 * 1024
DEFAULT_THREADS = 4
STAGED_MARKER = ".wakegate-staged.json"


@dataclass(frozen=True)
class StageFile:
    path: str
    """Relative to the model's root, and to the destination."""
    source: Path
    size: int
    blocks: tuple[str, ...] | None
    """SHA-256 hex per `block_size` block; None: not verified."""
    block_size: int = BLOCK_SIZE


@dataclass(frozen=True)
class Staged:
    root: Path | None
    """The destination directory (None when only the page cache was filled)."""
    files: tuple[str, ...]
    bytes: int
    seconds: float
    verified: bool
    direct: bool
    """Whether reads bypassed the page cache."""
    skipped: bool = False
    """The destination already held this entry."""

    @property
    def rate(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


def files_of(record: EntryRecord, root: Path) -> list[StageFile]:
    """What staging a cache entry reads: its files with their block tables."""
    return [StageFile(f.path, root / f.path, f.size, f.blocks, f.block_size) for f in record.files]


def files_in(root: Path, names: Sequence[str]) -> list[StageFile]:
    """Files without a block table (not verified)."""
    return [StageFile(n, root / n, (root / n).stat().st_size, None) for n in names]


def check_chunk_size(chunk_size: int) -> int:
    if chunk_size < 64 * 1024 or chunk_size % ALIGN:
        raise ValueError(f"chunk size {chunk_size} must be a multiple of {ALIGN} and at least 64 KiB")
    return chunk_size


def _open_source(path: Path, direct: bool) -> tuple[int, bool]:
    """(fd, O_DIRECT in effect): O_DIRECT when asked and the file system takes it."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
        else:
            probe = mmap.mmap(-1, ALIGN)
            try:
                os.preadv(fd, [probe], 0)
                return fd, True
            except OSError as exc:
                os.close(fd)
                if exc.errno != errno.EINVAL:
                    raise
            finally:
                probe.close()
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    return fd, False


def _staged_already(dest: Path, key: str | None, files: Sequence[StageFile]) -> bool:
    if key is None:
        return False
    try:
        marker = json.loads((dest / STAGED_MARKER).read_bytes())
    except (OSError, ValueError):
        return False
    if marker.get("key") != key:
        return False
    for f in files:
        try:
            if (dest / f.path).stat().st_size != f.size:
                return False
        except OSError:
            return False
    return True


def flash_load(
    files: Sequence[StageFile],
    dest: Path | None,
    *,
    key: str | None = None,
    label: str = "",
    threads: int = DEFAULT_THREADS,
    chunk_size: int = DEFAULT_CHUNK,
    direct: bool = True,
    progress: ProgressSink = ignore,
    clock: Callable[[], float] = time.monotonic,
) -> Staged:
    """Read (and with `dest`, copy) `files`, verifying every block that has a digest. Blocking;
    `progress` is called from the reading threads."""
    check_chunk_size(chunk_size)
    total = sum(f.size for f in files)
    names = tuple(f.path for f in files)
    verified = all(f.blocks is not None for f in files)
    start = clock()
    if dest is not None and _staged_already(dest, key, files):
        progress(Progress(Phase.READY, label, total, total, detail=f"already staged in {dest}"))
        return Staged(dest, names, total, 0.0, verified, False, skipped=True)
    tracker = Tracker(progress, Progress(Phase.STAGING, label, 0, total, detail=str(dest or "page cache")), start)
    lock = threading.Lock()
    local = threading.local()
    opened: list[tuple[int, bool, int | None, Path | None]] = []
    try:
        if dest is not None:
            dest.mkdir(parents=True, exist_ok=True)
            (dest / STAGED_MARKER).unlink(missing_ok=True)
            free = shutil.disk_usage(dest).free
            if free < total:
                raise DeliveryError(f"{dest}: {human_bytes(total)} do not fit in {human_bytes(free)} free",
                                    "cache_full")
        for f in files:
            safe_relative(f.path)
            src_fd, is_direct = _open_source(f.source, direct and dest is not None)
            out_fd, partial = None, None
            if dest is not None:
                partial = dest / f"{f.path}.{secrets.token_hex(4)}.partial"
                partial.parent.mkdir(parents=True, exist_ok=True)
                out_fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.ftruncate(out_fd, f.size)
            else:
                os.posix_fadvise(src_fd, 0, 0, os.POSIX_FADV_WILLNEED)
            opened.append((src_fd, is_direct, out_fd, partial))

        def buffer() -> mmap.mmap:
            buf: mmap.mmap | None = getattr(local, "buf", None)
            if buf is None:
                buf = mmap.mmap(-1, chunk_size)
                local.buf = buf
            return buf

        def read_block(job: tuple[int, int, int, int]) -> None:
            index, block, offset, length = job
            f = files[index]
            src_fd, is_direct, out_fd, _ = opened[index]
            view = memoryview(buffer())
            digest = hashlib.sha256() if f.blocks is not None else None
            done = 0
            while done < length:
                want = min(chunk_size, length - done)
                size = (want + ALIGN - 1) // ALIGN * ALIGN if is_direct else want
                got = min(os.preadv(src_fd, [view[:size]], offset + done), want)
                if got <= 0:
                    raise DeliveryError(f"{f.source}: file ended at {offset + done} bytes, expected {f.size}",
                                        "digest_mismatch")
                chunk = view[:got]
                if digest is not None:
                    digest.update(chunk)
                if out_fd is not None:
                    written = 0
                    while written < got:
                        written += os.pwrite(out_fd, chunk[written:], offset + done + written)
                done += got
                with lock:
                    tracker.advance(got, clock())
            if digest is not None and f.blocks is not None and digest.hexdigest() != f.blocks[block]:
                raise DigestMismatch(
                    f"{f.source}: block {block} (bytes {offset}-{offset + length - 1}) does not match its digest"
                )

        jobs = [(i, b, off, n) for i, f in enumerate(files)
                for b, (off, n) in enumerate(block_ranges(f.size, f.block_size))]
        jobs.sort(key=lambda job: (job[2], job[0]))
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="flash-load") as pool:
            for _ in pool.map(read_block, jobs):
                pass
        if dest is not None:
            for f, (_, _, out_fd, partial) in zip(files, opened, strict=True):
                assert out_fd is not None and partial is not None
                os.rename(partial, dest / f.path)
            marker = {"key": key, "files": [{"path": f.path, "size": f.size} for f in files]}
            (dest / STAGED_MARKER).write_text(json.dumps(marker))
    except BaseException as exc:
        tracker.finish(clock(), Phase.FAILED, str(exc))
        raise
    finally:
        for src_fd, _, out_fd, partial in opened:
            os.close(src_fd)
            if out_fd is not None:
                os.close(out_fd)
            if partial is not None:
                partial.unlink(missing_ok=True)
    end = clock()
    tracker.finish(end, Phase.READY, str(dest or "page cache"))
    return Staged(dest, names, total, end - start, verified, any(o[1] for o in opened))


async def stage(files: Sequence[StageFile], dest: Path | None, *, progress: ProgressSink = ignore,
                **options: object) -> Staged:
    """`flash_load` on a worker thread, with progress events delivered on the calling event loop."""
    loop = asyncio.get_running_loop()

    def on_loop(event: Progress) -> None:
        loop.call_soon_threadsafe(progress, event)

    return await asyncio.to_thread(flash_load, files, dest, progress=on_loop, **options)  # type: ignore[arg-type]
