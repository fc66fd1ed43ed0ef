"""The weights of `wakegate up`'s models: one cache and one registry access per process, one
resolution per engine start, its progress in the log and /status, and the flash stage.

    delivery = Delivery(DeliveryConfig(cache_dir=…), Access.from_env(…))   # one per `up`
    watch = WeightsWatch(model.key, str(model.spec.source))                  # one per model
    weights = await delivery.acquire(model, watch, base_dir=…, needs_file=True)
    start_engine(weights.path, pass_fds=weights.fds)                         # the lease goes along
    ...                                                                      # the engine exits
    weights.release()

`acquire` goes through `delivery.resolver.resolve`: `file://` is used in place; `oci://` and
`hf://` always come from this machine's cache (pulled when missing, a ready entry checked
first: a corrupt one is reported, removed and fetched again). With `spec.cache.flash` the
entry is then staged into the flash directory (a tmpfs) and the engine loads that copy; a copy
staged before is used again, and copies of entries the cache no longer holds are removed.
Every failure is a `DeliveryError` whose reason and message (never a credential) go to /status.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wakegate.control.delivery.cache import Cache
from wakegate.control.delivery.errors import DeliveryError, DigestMismatch
from wakegate.control.delivery.flashload import files_of, stage
from wakegate.control.delivery.index import dirname, key_of_dirname
from wakegate.control.delivery.progress import Phase, Progress
from wakegate.control.delivery.resolver import Access, Resolved, Verify, resolve
from wakegate.control.delivery.sources import HfSource, OciSource, parse_source
from wakegate.control.schema import LoRAAdapter, Model

log = logging.getLogger("wakegate.up")

#: Seconds between progress lines in the log while bytes move (phase changes are logged at once).
LOG_INTERVAL = 5.0


def default_flash_dir() -> Path:
    """A folder of this user's in /dev/shm (a tmpfs on Linux), else in the temporary directory."""
    shm = Path("/dev/shm")  # noqa: S108 - a folder of our own in it, owner-only (_private_dirs)
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"wakegate-{os.getuid()}" / "flash"


@dataclass(frozen=True)
class DeliveryConfig:
    """What `wakegate up`'s command line says about weights."""

    cache_dir: Path
    max_size: int | None = None
    verify: Verify = Verify.BLOCKS
    flash_dir: Path = field(default_factory=default_flash_dir)
    #: Threads that check a cached entry and stage it.
    threads: int = 4


@dataclass
class Weights:
    """What one engine start got: the path the engine loads, and the lease to let go after."""

    path: Path
    resolved: Resolved
    #: The flash copy the engine loads, when `spec.cache.flash` staged one.
    staged: Path | None = None

    @property
    def folder(self) -> Path:
        """The folder the weights came in (with their config and tokenizer): what engines that
        load a model or adapter folder (vLLM) are given, rather than its one weight file."""
        return self.staged if self.staged is not None else self.resolved.root

    @property
    def fds(self) -> tuple[int, ...]:
        """File descriptors the engine process inherits: the cache entry's lease, so that nothing
        evicts the entry while the engine runs, even if this process let go first."""
        lease = self.resolved.lease
        return (lease.fd,) if lease is not None and lease.fd >= 0 else ()

    def release(self) -> None:
        self.resolved.release()


class WeightsWatch:
    """The progress sink of one model: keeps the latest event for /status, writes phase changes
    (and every `LOG_INTERVAL` seconds while bytes move) to the log, and counts pulls and
    corrupt entries found."""

    def __init__(self, model: str, source: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model
        self.source = source
        self._clock = clock
        self.progress: Progress | None = None
        self.path: Path | None = None
        self.entry: str | None = None
        self.staged: Path | None = None
        self.pulls = 0
        self.corrupt = 0
        self.last_corrupt = ""
        self.error: DeliveryError | None = None
        #: Called with (bytes, seconds) when a pull finished, and with the problem of a corrupt entry.
        self.on_pulled: Callable[[int, float], None] | None = None
        self.on_corrupt: Callable[[str], None] | None = None
        self._logged_at = 0.0
        self._pull_started: float | None = None
        self._pulled_bytes = 0

    def __call__(self, event: Progress) -> None:
        now = self._clock()
        before = self.progress.phase if self.progress is not None else None
        self.progress = event
        if event.phase is Phase.PULLING:
            if self._pull_started is None:
                self._pull_started = now
            self._pulled_bytes = event.done
        if event.phase is Phase.CORRUPT and before is not Phase.CORRUPT:
            self.corrupt += 1
            self.last_corrupt = event.detail
            if self.on_corrupt is not None:
                self.on_corrupt(event.detail)
        if event.phase in (Phase.READY, Phase.FAILED) and self._pull_started is not None:
            if event.phase is Phase.READY:
                self.pulls += 1
                if self.on_pulled is not None:  # the closing event carries the pull's byte count
                    self.on_pulled(max(self._pulled_bytes, event.done), now - self._pull_started)
            self._pull_started = None
            self._pulled_bytes = 0
        if event.phase is not before or now - self._logged_at >= LOG_INTERVAL or event.phase is Phase.READY:
            self._logged_at = now
            level = logging.WARNING if event.phase in (Phase.CORRUPT, Phase.FAILED) else logging.INFO
            log.log(level, "weights model=%s %s", self.model, event.line())

    def started(self) -> None:
        """A new resolution begins (the last error is history once it succeeds)."""
        self._pull_started = None

    def got(self, weights: Weights) -> None:
        self.error = None
        self.path = weights.path
        self.staged = weights.staged
        record = weights.resolved.record
        self.entry = record.key if record is not None else None

    def failed(self, error: DeliveryError) -> None:
        self.error = error
        if self.progress is None or self.progress.phase is not Phase.FAILED:  # cut short (a timeout)
            self(Progress(Phase.FAILED, self.source, detail=str(error)))

    def status(self) -> dict[str, Any]:
        event = self.progress
        return {
            "source": self.source,
            "path": str(self.path) if self.path is not None else None,
            "entry": self.entry,
            "staged": str(self.staged) if self.staged is not None else None,
            "progress": None if event is None else {
                "phase": event.phase.value,
                "done_bytes": event.done,
                "total_bytes": event.total,
                "rate_bytes_per_second": round(event.rate, 1) if event.rate is not None else None,
                "eta_seconds": round(event.eta, 1) if event.eta is not None else None,
                "detail": event.detail,
                "line": event.line(),
            },
            "pulls": self.pulls,
            "corrupt_found": self.corrupt,
            "last_corrupt": self.last_corrupt,
            "error": None if self.error is None else {"reason": self.error.reason, "message": str(self.error)},
        }


class Delivery:
    """Weights for every model of one `wakegate up`: the machine's cache (made when a source
    first needs it, so a fleet of `file://` models never creates one) and its registry access."""

    def __init__(self, config: DeliveryConfig, access: Access) -> None:
        self.config = config
        self.access = access
        self._cache: Cache | None = None
        self._staging: dict[str, asyncio.Lock] = {}

    @property
    def cache(self) -> Cache:
        if self._cache is None:
            self._cache = Cache(self.config.cache_dir, self.config.max_size)
        return self._cache

    async def acquire(self, model: Model, watch: WeightsWatch, *, base_dir: Path | None,
                      needs_file: bool, folder: bool = False) -> Weights:
        """The weights of one engine start of `model` (which has a `spec.source`), leased; with
        `folder`, the path is the source's folder even where it holds a single weight file."""
        assert model.spec.source is not None
        watch.started()
        try:
            weights = await self._acquire(model.spec.source, model.spec.cache.flash, watch, base_dir)
            if needs_file and not weights.path.is_file():
                weights.release()
                raise DeliveryError(f"{model.spec.source}: the engine loads one weight file, and {weights.path} "
                                    "is a folder", "bad_source")
            if folder:
                weights.path = weights.folder
        except DeliveryError as exc:
            watch.failed(exc)
            raise
        watch.got(weights)
        return weights

    async def acquire_adapter(self, adapter: LoRAAdapter, watch: WeightsWatch, *, base_dir: Path | None) -> Weights:
        """A LoRAAdapter's weights, through the same cache as every base's, leased."""
        watch.started()
        try:
            weights = await self._acquire(adapter.spec.source, False, watch, base_dir)
        except DeliveryError as exc:
            watch.failed(exc)
            raise
        watch.got(weights)
        return weights

    async def _acquire(self, text: str, flash: bool, watch: WeightsWatch, base_dir: Path | None) -> Weights:
        source = parse_source(text)
        cache = self.cache if isinstance(source, OciSource | HfSource) else None
        # Staging checks every block as it copies, so a flash start has resolve check sizes only;
        # a block found corrupt there takes the entry out and fetches it again, once.
        verify = Verify.SIZES if flash else self.config.verify
        for last in (False, True):
            resolved = await resolve(source, cache, access=self.access, progress=watch, verify=verify,
                                     base_dir=base_dir, threads=self.config.threads)
            record = resolved.record
            if not flash or record is None:
                return Weights(resolved.model_path, resolved)
            try:
                staged = await self._stage(resolved, watch)
            except DigestMismatch as exc:
                resolved.release()
                if last:
                    raise
                watch(Progress(Phase.CORRUPT, str(source), detail=f"{record.key}: {exc}; fetching again"))
                self.cache.quarantine(record.key, str(exc))
                continue
            except BaseException:
                resolved.release()
                raise
            primary = record.primary
            return Weights(staged / primary if primary else staged, resolved, staged)
        raise AssertionError("unreachable")

    async def _stage(self, resolved: Resolved, watch: WeightsWatch) -> Path:
        """The entry's copy in the flash directory: staged (every block checked) unless a copy
        of this entry is there already; one staging per entry at a time in this process."""
        record = resolved.record
        assert record is not None
        lock = self._staging.setdefault(record.key, asyncio.Lock())
        async with lock:
            await asyncio.to_thread(self.sweep_flash)
            dest = self.config.flash_dir / dirname(record.key)
            await asyncio.to_thread(_private_dirs, self.config.flash_dir)
            await stage(files_of(record, resolved.root), dest, key=record.key, label=watch.source,
                        threads=self.config.threads, progress=watch)
            return dest

    def sweep_flash(self) -> list[str]:
        """Remove the flash copies of entries the cache no longer holds; returns their keys."""
        root = self.config.flash_dir
        removed: list[str] = []
        if not root.is_dir():
            return removed
        for child in root.iterdir():
            key = key_of_dirname(child.name)
            if key is None or self.cache.record(key) is not None:
                continue
            shutil.rmtree(child, ignore_errors=True)
            log.info("flash: removed the staged copy of %s (no longer in the cache %s)", key, self.cache.root)
            removed.append(key)
        return removed


def _private_dirs(path: Path) -> None:
    """`path` and its parent, created owner-only (a tmpfs is shared by every user)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.mkdir(mode=0o700, exist_ok=True)
