"""`wakegate flash-load SOURCE [DEST]`: stage a cached model into fast storage before an engine starts.

SOURCE is a source (`oci://…`, `hf://…`, `file://…`; pulled into the cache first if it is not
there), a cache key (`sha256:…`), or a plain path to a model file or folder (read as `file://`).
With DEST (a directory, e.g. on /dev/shm) the model's files
are copied there; without it they are read into the page cache. Either way every block of a
cached model is checked against its digest on the way (`wakegate.control.delivery.flashload`);
the backends call the same function before they start an engine. The entry is leased while it
is read, so it cannot be evicted meanwhile. Prints where the model is, and the rate.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path

from wakegate.control.delivery.console import DeliverySettings, add_cache_arguments, size_argument
from wakegate.control.delivery.errors import DeliveryError
from wakegate.control.delivery.flashload import (
    DEFAULT_CHUNK,
    DEFAULT_THREADS,
    check_chunk_size,
    files_in,
    files_of,
    stage,
)
from wakegate.control.delivery.progress import human_bytes
from wakegate.control.delivery.resolver import Resolved, cached, resolve
from wakegate.control.delivery.sources import parse_digest, parse_source
from wakegate.process import add_log_level, settings_from, start

DIGEST_PREFIXES = ("sha256:", "sha512:")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="a source (oci://, hf://, file://), a cache key (sha256:…) or a local path")
    parser.add_argument("dest", nargs="?", type=Path, default=None,
                        help="directory to copy the model into (e.g. /dev/shm/NAME); omitted: fill the page cache")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="parallel read streams")
    parser.add_argument("--chunk-size", type=size_argument, default=DEFAULT_CHUNK, metavar="SIZE",
                        help=f"bytes per read, a multiple of 4K (default: {DEFAULT_CHUNK // (1 << 20)}M)")
    parser.add_argument("--no-direct", dest="direct", action="store_false",
                        help="read through the page cache even when copying (default: O_DIRECT where possible)")
    add_cache_arguments(parser)
    add_log_level(parser)


@dataclass(frozen=True, kw_only=True)
class Settings(DeliverySettings):
    """One `wakegate flash-load` run."""

    source: str
    """What to stage: a source or a cache key."""
    dest: Path | None
    """Where to copy it; None: the page cache only."""
    threads: int
    """Parallel read streams."""
    chunk_size: int
    """Bytes per read."""
    direct: bool
    """O_DIRECT reads when copying."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        if args.threads < 1:
            raise ValueError("--threads must be at least 1")
        check_chunk_size(args.chunk_size)
        args.source = source_argument(args.source)
        return settings_from(cls, args)


def source_argument(text: str) -> str:
    """SOURCE as given, made a source or a cache key: a plain path becomes `file://` its absolute
    path (it must exist); text that starts like a digest must be one."""
    if "://" in text:
        parse_source(text)
        return text
    if text.startswith(DIGEST_PREFIXES):
        return parse_digest(text)
    path = Path(text).expanduser()
    if not path.exists():
        raise ValueError(
            f"{text!r} is neither a source (oci://, hf://, file://), a cache key (sha256:…), nor an existing path"
        )
    return f"file://{path.resolve()}"


def main(args: argparse.Namespace) -> int:
    return start(args, Settings.from_args, run, "flash-load")


async def _resolve(s: Settings) -> Resolved:
    if "://" not in s.source:
        return await cached(s.cache(), s.source)
    return await resolve(s.source, s.cache(), access=s.access(), progress=s.printer())


async def _flash_load(s: Settings) -> int:
    printer = s.printer()
    resolved = await _resolve(s)
    try:
        files = files_of(resolved.record, resolved.root) if resolved.record else files_in(resolved.root, resolved.files)
        staged = await stage(files, s.dest, progress=printer, key=resolved.record.key if resolved.record else None,
                             label=str(resolved.source), threads=s.threads, chunk_size=s.chunk_size, direct=s.direct)
    finally:
        resolved.release()
        printer.close()
    where = staged.root or resolved.root
    primary = resolved.primary.relative_to(resolved.root) if resolved.primary else None
    print(where / primary if primary else where)
    note = "already staged" if staged.skipped else (
        f"{human_bytes(staged.bytes)} in {staged.seconds:.2f}s, {human_bytes(staged.rate)}/s"
        f"{', O_DIRECT' if staged.direct else ''}")
    if not staged.verified:
        note += "; not verified: this source carries no digests"
    print(f"wakegate flash-load: {note}", file=sys.stderr)
    return 0


def run(s: Settings) -> int:
    try:
        return asyncio.run(_flash_load(s))
    except DeliveryError as exc:
        print(f"wakegate flash-load: {exc}", file=sys.stderr, flush=True)
        return 1
