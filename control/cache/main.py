"""`wakegate cache`: the model cache for people: pull, ls, rm, push.

    wakegate cache pull oci://registry.example/models/llama:q4   # into the cache, with progress
    wakegate cache ls [--json]                                   # entries, sizes, last use, leases
    wakegate cache rm sha256:1a2b… | SOURCE [--force]            # not while in use, unless forced
    wakegate cache push model.gguf oci://registry.example/models/llama:q4

`pull` always asks the registry or Hub which digest a tag or branch names (a pinned digest is
served from the cache); `wakegate up` and the backends call the same code through
`wakegate.control.delivery.resolver.resolve`. Errors are one line on stderr and status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from wakegate.control.delivery.cache import Cache
from wakegate.control.delivery.console import DeliverySettings, add_cache_arguments
from wakegate.control.delivery.errors import DeliveryError, SourceError
from wakegate.control.delivery.progress import human_bytes
from wakegate.control.delivery.pushing import push
from wakegate.control.delivery.resolver import Policy, resolve
from wakegate.control.delivery.sources import OciSource, parse_digest, parse_source
from wakegate.process import add_log_level, settings_from, start

ACTIONS = ("pull", "ls", "rm", "push")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_cache_arguments(parser)
    add_log_level(parser)
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    pull = sub.add_parser("pull", help="fetch a source into the cache (oci://, hf://)")
    pull.add_argument("source", help="oci://REGISTRY/REPO:TAG, oci://…@sha256:…, hf://ORG/REPO[@REV][/PATH]")
    ls = sub.add_parser("ls", help="list the cache's entries")
    ls.add_argument("--json", action="store_true", help="one JSON object per entry on stdout")
    rm = sub.add_parser("rm", help="remove entries (by key, key prefix, or source)")
    rm.add_argument("targets", nargs="+", metavar="KEY|SOURCE")
    rm.add_argument("--force", action="store_true", help="remove even while an engine holds a lease on it")
    pushing = sub.add_parser("push", help="publish a file or directory as a ModelPack OCI artifact")
    pushing.add_argument("path", type=Path, help="a GGUF (or any model file), or a directory")
    pushing.add_argument("target", help="oci://REGISTRY/REPO:TAG")
    pushing.add_argument("--name", default=None, help="the model name in the artifact's config (default: file name)")


@dataclass(frozen=True, kw_only=True)
class Settings(DeliverySettings):
    """One `wakegate cache` invocation."""

    action: str
    """pull, ls, rm or push."""
    source: str | None = None
    """What `pull` fetches."""
    json: bool = False
    """`ls` as JSON lines."""
    targets: tuple[str, ...] = ()
    """What `rm` removes."""
    force: bool = False
    """`rm` entries in use too."""
    path: Path | None = None
    """What `push` publishes."""
    target: str | None = None
    """Where `push` publishes it."""
    name: str | None = None
    """The model name `push` records."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        if getattr(args, "source", None):
            parse_source(args.source)
        if getattr(args, "target", None):
            parse_source(args.target)
        return settings_from(cls, args, targets=tuple(getattr(args, "targets", ()) or ()))


def main(args: argparse.Namespace) -> int:
    return start(args, Settings.from_args, run, "cache")


def run(s: Settings) -> int:
    try:
        if s.action == "pull":
            return _pull(s)
        if s.action == "ls":
            return _ls(s)
        if s.action == "rm":
            return _rm(s)
        return _push(s)
    except DeliveryError as exc:
        print(f"wakegate cache {s.action}: {exc}", file=sys.stderr, flush=True)
        return 1


def _pull(s: Settings) -> int:
    assert s.source is not None
    printer = s.printer()
    try:
        resolved = asyncio.run(resolve(s.source, s.cache(), access=s.access(), progress=printer, policy=Policy.ALWAYS))
    finally:
        printer.close()
    resolved.release()
    print(resolved.model_path)
    return 0


def _ls(s: Settings) -> int:
    cache = s.cache()
    entries = sorted(cache.entries(), key=lambda e: e.last_used, reverse=True)
    if s.json:
        for e in entries:
            print(json.dumps({
                "key": e.record.key, "source": e.record.source, "size": e.record.size, "created": e.record.created,
                "lastUsed": e.last_used, "inUse": e.in_use, "path": str(cache.files_dir(e.record.key)),
                "files": [f.path for f in e.record.files],
            }))
        for key, size, pulling in cache.partials():
            print(json.dumps({"key": key, "partial": True, "size": size, "pulling": pulling}))
        return 0
    rows = [("KEY", "SIZE", "LAST USED", "IN USE", "SOURCE")]
    for e in entries:
        rows.append((e.record.key[:19], human_bytes(e.record.size), _when(e.last_used),
                     "yes" if e.in_use else "no", e.record.source))
    for key, size, pulling in cache.partials():
        rows.append((key[:19], human_bytes(size), "-", "-", "(being pulled)" if pulling else "(partial, resumable)"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    total = sum(e.record.size for e in entries)
    budget = f" of {human_bytes(s.max_size)}" if s.max_size else ""
    print(f"{len(entries)} entries, {human_bytes(total)}{budget} in {cache.root}")
    return 0


def _when(stamp: float) -> str:
    return dt.datetime.fromtimestamp(stamp).strftime("%Y-%m-%d %H:%M")


def _keys_for(cache: Cache, target: str) -> list[str]:
    """The entry keys `target` names: a full key, a unique key prefix, or a source."""
    if "://" in target:
        src = parse_source(target)
        ref = cache.read_ref(str(src))
        if ref is not None:
            return [ref.key]
        if isinstance(src, OciSource) and src.digest:
            return [src.digest]
        raise SourceError(f"{target} is not in the cache", "not_found")
    if ":" not in target:
        target = f"sha256:{target}"
    try:
        return [parse_digest(target)]
    except SourceError:
        matches = [k for k in cache.keys() if k.startswith(target)]  # noqa: SIM118 (a method, not a dict)
        if len(matches) != 1 or len(target) < 12:
            raise SourceError(f"{target!r} names {len(matches)} entries; give a longer prefix or the full key",
                              "not_found") from None
        return matches


def _rm(s: Settings) -> int:
    cache = s.cache()
    status = 0
    for target in s.targets:
        for key in _keys_for(cache, target):
            if cache.record(key) is None and not cache.staging_dir(key).exists():
                print(f"wakegate cache rm: {key} is not in the cache", file=sys.stderr)
                status = 1
            elif cache.remove(key, force=s.force):
                print(f"removed {key}")
            else:
                print(f"wakegate cache rm: {key} is in use (a running engine holds a lease); --force removes it anyway",
                      file=sys.stderr)
                status = 1
    return status


def _push(s: Settings) -> int:
    assert s.path is not None and s.target is not None
    printer = s.printer()
    try:
        digest = asyncio.run(push(s.path, s.target, settings=s.access().registry, progress=printer, name=s.name))
    finally:
        printer.close()
    target = parse_source(s.target)
    assert isinstance(target, OciSource)
    print(f"oci://{target.registry}/{target.repository}@{digest}")
    return 0
