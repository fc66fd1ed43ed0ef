"""Flash loading: the staged copy is the cached bytes, checked block by block on the way."""

from __future__ import annotations

import os
import time
from pathlib import Path, PurePosixPath

import pytest

from tests.control.delivery.conftest import weights
from wakegate.control.delivery.cache import Cache
from wakegate.control.delivery.digests import Digester
from wakegate.control.delivery.errors import DigestMismatch
from wakegate.control.delivery.flashload import STAGED_MARKER, files_in, files_of, flash_load
from wakegate.control.delivery.index import EntryRecord, FileRecord
from wakegate.control.delivery.progress import Phase, Progress

MB = 1024 * 1024


def cached(cache: Cache, path: Path, block_size: int = 1 * MB) -> EntryRecord:
    """`path` as a ready cache entry (what a pull leaves), without a registry."""
    digester = Digester(block_size=block_size)
    digester.update(path.read_bytes())
    digests = digester.result()
    staging = cache.staging_dir(digests.digest) / "files"
    staging.mkdir(parents=True)
    (staging / path.name).write_bytes(path.read_bytes())
    record = EntryRecord(
        digests.digest, f"file://{path}", digests.size, time.time(), (FileRecord.of(PurePosixPath(path.name), digests),)
    )
    cache.commit(staging.parent, record)
    return record


def test_a_staged_copy_is_the_cached_bytes_and_is_not_copied_twice(tmp_path: Path) -> None:
    model = weights(tmp_path / "src", 5 * MB + 1234)
    cache = Cache(tmp_path / "cache")
    record = cached(cache, model)
    events: list[Progress] = []
    dest = tmp_path / "shm"
    staged = flash_load(
        files_of(record, cache.files_dir(record.key)),
        dest,
        key=record.key,
        threads=3,
        chunk_size=256 * 1024,
        progress=events.append,
    )
    assert (dest / "tiny.gguf").read_bytes() == model.read_bytes()
    assert staged.verified and not staged.skipped and staged.bytes == model.stat().st_size
    assert sorted(p.name for p in dest.iterdir()) == [STAGED_MARKER, "tiny.gguf"]
    assert events[0].phase is Phase.STAGING and events[-1].phase is Phase.READY
    assert events[-1].done == staged.bytes
    again = flash_load(files_of(record, cache.files_dir(record.key)), dest, key=record.key)
    assert again.skipped


def test_a_corrupt_block_fails_the_staging_and_leaves_nothing_behind(tmp_path: Path) -> None:
    model = weights(tmp_path / "src", 4 * MB)
    cache = Cache(tmp_path / "cache")
    record = cached(cache, model)
    with open(cache.files_dir(record.key) / "tiny.gguf", "r+b") as f:
        f.seek(2 * MB + 5)
        byte = f.read(1)
        f.seek(2 * MB + 5)
        f.write(bytes([byte[0] ^ 0xFF]))  # flipped: a fixed byte is already there once in 256 runs
    dest = tmp_path / "shm"
    with pytest.raises(DigestMismatch, match=r"block 2 \(bytes 2097152-3145727\)"):
        flash_load(
            files_of(record, cache.files_dir(record.key)), dest, key=record.key, threads=2, chunk_size=128 * 1024
        )
    assert list(dest.iterdir()) == []


def test_the_page_cache_mode_reads_and_checks_without_copying(tmp_path: Path) -> None:
    model = weights(tmp_path / "src", 3 * MB)
    cache = Cache(tmp_path / "cache")
    record = cached(cache, model)
    staged = flash_load(files_of(record, cache.files_dir(record.key)), None, threads=2, chunk_size=64 * 1024)
    assert staged.root is None and staged.verified and not staged.direct and staged.bytes == 3 * MB


def test_files_without_digests_are_copied_and_said_to_be_unverified(tmp_path: Path) -> None:
    model = weights(tmp_path / "src", MB + 3)
    staged = flash_load(files_in(model.parent, ["tiny.gguf"]), tmp_path / "out")
    assert not staged.verified and (tmp_path / "out" / "tiny.gguf").read_bytes() == model.read_bytes()


@pytest.mark.parametrize("chunk", [1000, 4096, 65536 + 1])
def test_a_chunk_size_that_cannot_be_aligned_is_refused(tmp_path: Path, chunk: int) -> None:
    with pytest.raises(ValueError, match="multiple of 4096"):
        flash_load([], tmp_path, chunk_size=chunk)
    assert not os.listdir(tmp_path)
