"""The content-addressed model cache on disk: entries, their readiness, leases, locks, eviction.

Layout under the cache directory (one per machine or node; shared by every process there):

    entries/sha256-HEX/             a ready entry: renamed here only after every file verified
        entry.json                  the readiness marker (index.EntryRecord)
        manifest.json, config.json  the artifact's own documents (OCI), for reference
        files/…                     the model's files, as the artifact names them
    tmp/sha256-HEX/                 an entry being written (resumable), owned by its pull lock
    refs/HASH.json                  what a tag or branch last resolved to (index.RefRecord)
    locks/sha256-HEX.pull           held (flock, exclusive) by the one process downloading a key
    locks/sha256-HEX.use            held shared by every user of a key (a lease); its mtime is the
                                    entry's last use; eviction takes it exclusively, without waiting
    locks/evict.lock                one eviction at a time
    trash/                          entries being deleted (renamed here first, so they vanish at once)

Only `entries/` is ever read for models, and an entry without a valid marker is ignored, so a
half-written one is never used. Locks are `flock`s: the kernel drops them when their process
dies, so a crashed puller or engine never leaves a lock behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from wakegate.control.delivery.digests import block_ranges
from wakegate.control.delivery.errors import CacheFull, MarkerError
from wakegate.control.delivery.index import (
    EntryRecord,
    EntryUse,
    EvictionPlan,
    FileRecord,
    RefRecord,
    dirname,
    key_of_dirname,
    plan_eviction,
    ref_name,
)
from wakegate.control.delivery.progress import human_bytes

log = logging.getLogger("wakegate.delivery")

MARKER = "entry.json"
FILES = "files"
#: bytes kept free on the cache's file system beyond any budget
RESERVE = 256 * 1024 * 1024
#: how often a process waiting for a lock looks again
LOCK_POLL = 0.05
READ_CHUNK = 8 * 1024 * 1024


def default_cache_dir() -> Path:
    """`$WAKEGATE_CACHE_DIR`, else `$XDG_CACHE_HOME/wakegate/models`, else `~/.cache/wakegate/models`."""
    if os.environ.get("WAKEGATE_CACHE_DIR"):
        return Path(os.environ["WAKEGATE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "wakegate" / "models"


def parse_size(text: str) -> int:
    """`500M`, `20G`, `1.5T`, `1000000` (bytes; K/M/G/T are powers of 1024, `GB` etc. of 1000)."""
    value = text.strip().upper()
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40,
             "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 1 << 10, "MIB": 1 << 20,
             "GIB": 1 << 30, "TIB": 1 << 40, "B": 1}
    for suffix in sorted(units, key=len, reverse=True):
        if value.endswith(suffix):
            number, scale = value[: -len(suffix)].strip(), units[suffix]
            break
    else:
        number, scale = value, 1
    try:
        size = float(number) * scale
    except ValueError:
        raise ValueError(f"{text!r} is not a size (e.g. 500M, 20G)") from None
    if size <= 0:
        raise ValueError(f"{text!r} is not a positive size")
    return int(size)


class Lease:
    """A shared lock on an entry: while held, eviction leaves the entry alone. Its file descriptor
    can be handed to a child process (`pass_fds`); the lease then lasts until both let go."""

    def __init__(self, key: str, fd: int) -> None:
        self.key = key
        self.fd = fd

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(frozen=True)
class EntryInfo:
    """An entry as `wakegate cache ls` shows it."""

    record: EntryRecord
    path: Path
    last_used: float
    in_use: bool


@dataclass(frozen=True)
class Problem:
    """Why an entry failed its check."""

    file: str
    detail: str

    def __str__(self) -> str:
        return f"{self.file}: {self.detail}"


def _lock_nb(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return False
        raise


def _held(path: Path) -> bool:
    """Whether any process holds a lock on `path` (tried exclusively, without waiting)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        return not _lock_nb(fd, fcntl.LOCK_EX)
    finally:
        os.close(fd)


async def _lock(fd: int, kind: int, on_wait: Callable[[], None] | None = None) -> None:
    """Take a flock without blocking the event loop (polling), calling `on_wait` while it waits."""
    while not _lock_nb(fd, kind):
        if on_wait is not None:
            on_wait()
        await asyncio.sleep(LOCK_POLL)


def tree_size(path: Path) -> int:
    """Bytes in the regular files under `path` (0 if it is gone)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


class Cache:
    def __init__(self, root: Path, max_bytes: int | None = None) -> None:
        self.root = root
        self.max_bytes = max_bytes
        for sub in ("entries", "tmp", "refs", "locks", "trash"):
            (root / sub).mkdir(parents=True, exist_ok=True)

    # -- paths --------------------------------------------------------------------------------

    def entry_dir(self, key: str) -> Path:
        return self.root / "entries" / dirname(key)

    def files_dir(self, key: str) -> Path:
        return self.entry_dir(key) / FILES

    def staging_dir(self, key: str) -> Path:
        return self.root / "tmp" / dirname(key)

    def _lock_path(self, key: str, kind: str) -> Path:
        return self.root / "locks" / f"{dirname(key)}.{kind}"

    # -- reading ------------------------------------------------------------------------------

    def record(self, key: str) -> EntryRecord | None:
        """The entry's marker if the entry is ready (its marker valid), else None."""
        try:
            body = (self.entry_dir(key) / MARKER).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            return EntryRecord.from_json(body, key)
        except MarkerError as exc:
            log.warning("cache entry %s has a bad marker (%s); it is not used", key, exc)
            return None

    def keys(self) -> list[str]:
        out = []
        for child in sorted((self.root / "entries").iterdir()):
            key = key_of_dirname(child.name)
            if key is not None:
                out.append(key)
        return out

    def entries(self) -> list[EntryInfo]:
        out = []
        for key in self.keys():
            record = self.record(key)
            if record is not None:
                out.append(EntryInfo(record, self.entry_dir(key), self.last_used(key), self.in_use(key)))
        return out

    def partials(self) -> list[tuple[str, int, bool]]:
        """(key, bytes so far, being pulled now) of every entry being or left half written."""
        out = []
        for child in sorted((self.root / "tmp").iterdir()):
            key = key_of_dirname(child.name)
            if key is not None:
                out.append((key, tree_size(child), self._pulling(key)))
        return out

    def last_used(self, key: str) -> float:
        try:
            return self._lock_path(key, "use").stat().st_mtime
        except FileNotFoundError:
            record = self.record(key)
            return record.created if record else 0.0

    def in_use(self, key: str) -> bool:
        """Whether a lease is held on `key` (by any process)."""
        return _held(self._lock_path(key, "use"))

    def _pulling(self, key: str) -> bool:
        return _held(self._lock_path(key, "pull"))

    # -- refs ---------------------------------------------------------------------------------

    def read_ref(self, source: str) -> RefRecord | None:
        try:
            record = RefRecord.from_json((self.root / "refs" / ref_name(source)).read_bytes())
        except FileNotFoundError:
            return None
        return record if record is not None and record.source == source else None

    def write_ref(self, source: str, key: str) -> None:
        _write_atomic(self.root / "refs" / ref_name(source), RefRecord(source, key, time.time()).to_json())

    # -- leases and pull locks ----------------------------------------------------------------

    async def lease(self, key: str) -> Lease:
        """A lease on `key`, whether or not the entry is ready yet (take it before pulling, so that
        nothing evicts the entry between its commit and its use). Touches the entry's last use."""
        path = self._lock_path(key, "use")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            await _lock(fd, fcntl.LOCK_SH)
            os.utime(fd)
        except BaseException:
            os.close(fd)
            raise
        return Lease(key, fd)

    @contextlib.asynccontextmanager
    async def pull_lock(self, key: str, on_wait: Callable[[int], None] | None = None) -> AsyncIterator[Path]:
        """Hold the one right to write `key`; yields its staging directory (kept from an earlier
        broken pull, for resuming). `on_wait(bytes_so_far)` is called while another process holds it."""
        fd = os.open(self._lock_path(key, "pull"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        staging = self.staging_dir(key)
        try:
            await _lock(fd, fcntl.LOCK_EX, (lambda: on_wait(tree_size(staging))) if on_wait else None)
            staging.mkdir(exist_ok=True)
            yield staging
        finally:
            os.close(fd)

    @contextlib.asynccontextmanager
    async def filling(self, key: str, total: int, on_wait: Callable[[int], None] | None = None
                      ) -> AsyncIterator[Path | None]:
        """The pull lock of `key` for a fetch of `total` bytes: yields None when another process
        finished the entry meanwhile, else the staging directory with room made and its files
        folder created; the caller fills it and commits."""
        async with self.pull_lock(key, on_wait) as staging:
            if self.record(key) is not None:
                yield None
                return
            self.make_room(total, keep=[key])
            (staging / FILES).mkdir(exist_ok=True)
            yield staging

    def commit(self, staging: Path, record: EntryRecord) -> Path:
        """Make a fully verified staging directory the ready entry: marker written and synced,
        then one rename. The caller holds the pull lock."""
        _write_atomic(staging / MARKER, record.to_json())
        _fsync_dir(staging)
        target = self.entry_dir(record.key)
        if target.exists():
            self._to_trash(target)
        os.rename(staging, target)
        _fsync_dir(target.parent)
        log.info("cache: %s ready (%s, %s)", record.key, record.source, human_bytes(record.size))
        return target

    def quarantine(self, key: str, why: str) -> None:
        """Take a corrupt entry out at once (users holding its files open keep their bytes)."""
        target = self.entry_dir(key)
        if target.exists():
            log.warning("cache: %s is corrupt (%s); removed, it will be fetched again", key, why)
            self._to_trash(target)
            self._empty_trash()

    # -- removal and eviction -----------------------------------------------------------------

    def remove(self, key: str, force: bool = False) -> bool:
        """Delete an entry unless it is in use (or `force`); False when in use."""
        fd = os.open(self._lock_path(key, "use"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            if not _lock_nb(fd, fcntl.LOCK_EX) and not force:
                return False
            target = self.entry_dir(key)
            if target.exists():
                self._to_trash(target)
            staging = self.staging_dir(key)
            if staging.exists() and not self._pulling(key):
                self._to_trash(staging)
            for ref in (self.root / "refs").iterdir():
                record = RefRecord.from_json(ref.read_bytes())
                if record is None or record.key == key:
                    ref.unlink(missing_ok=True)
        finally:
            os.close(fd)
        self._empty_trash()
        return True

    def make_room(self, incoming: int, keep: Sequence[str] = ()) -> EvictionPlan:
        """Evict least recently used entries not in use until `incoming` more bytes fit both the
        budget and the file system; CacheFull (nothing removed) when they cannot."""
        lock = os.open(self.root / "locks" / "evict.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            for _ in range(5):
                infos = self.entries()
                uses = [EntryUse(i.record.key, i.record.size, i.last_used, i.in_use) for i in infos]
                stored = sum(u.size for u in uses)
                free = shutil.disk_usage(self.root).free - RESERVE
                budget = stored + free
                if self.max_bytes is not None:
                    budget = min(budget, self.max_bytes)
                plan = plan_eviction(uses, budget, incoming, frozenset(keep))
                if not plan.fits:
                    limit = f"budget {human_bytes(self.max_bytes)}" if self.max_bytes else "free disk space"
                    raise CacheFull(
                        f"cache {self.root}: {human_bytes(incoming)} does not fit ({limit}; "
                        f"{human_bytes(plan.in_use_bytes)} held by entries in use, "
                        f"{human_bytes(max(0, free))} free on disk)")
                if all(self._evict(key) for key in plan.evict):
                    return plan
            raise CacheFull(f"cache {self.root}: entries kept coming into use while making room")
        finally:
            os.close(lock)

    def _evict(self, key: str) -> bool:
        fd = os.open(self._lock_path(key, "use"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            if not _lock_nb(fd, fcntl.LOCK_EX):
                return False
            target = self.entry_dir(key)
            if target.exists():
                log.info("cache: evicting %s (least recently used)", key)
                self._to_trash(target)
        finally:
            os.close(fd)
        self._empty_trash()
        return True

    def _to_trash(self, path: Path) -> None:
        os.rename(path, self.root / "trash" / f"{path.name}.{secrets.token_hex(4)}")

    def _empty_trash(self) -> None:
        for child in (self.root / "trash").iterdir():
            shutil.rmtree(child, ignore_errors=True)

    # -- checks -------------------------------------------------------------------------------

    def check(self, record: EntryRecord, threads: int = 4, full: bool = True) -> Problem | None:
        """The first problem with an entry's files, or None. Sizes always; with `full`, every
        block against the marker's block table, on `threads` threads (reads go through the page
        cache, so an engine that loads next reads from memory)."""
        root = self.files_dir(record.key)
        for f in record.files:
            try:
                size = (root / f.path).stat().st_size
            except FileNotFoundError:
                return Problem(f.path, "missing")
            if size != f.size:
                return Problem(f.path, f"{size} bytes, expected {f.size}")
        if not full:
            return None
        jobs = [(f, i, off, n) for f in record.files for i, (off, n) in enumerate(block_ranges(f.size, f.block_size))]
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="cache-check") as pool:
            for problem in pool.map(lambda job: _check_block(root, *job), jobs):
                if problem is not None:
                    return problem
        return None


def _check_block(root: Path, f: FileRecord, index: int, offset: int, length: int) -> Problem | None:
    digest = hashlib.sha256()
    fd = os.open(root / f.path, os.O_RDONLY)
    try:
        done = 0
        while done < length:
            chunk = os.pread(fd, min(READ_CHUNK, length - done), offset + done)
            if not chunk:
                break
            digest.update(chunk)
            done += len(chunk)
    finally:
        os.close(fd)
    if index >= len(f.blocks) or digest.hexdigest() != f.blocks[index]:
        return Problem(f.path, f"block {index} (bytes {offset}-{offset + length - 1}) does not match its digest")
    return None


def _write_atomic(path: Path, body: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    with open(tmp, "wb") as out:
        out.write(body)
        out.flush()
        os.fsync(out.fileno())
    os.rename(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
