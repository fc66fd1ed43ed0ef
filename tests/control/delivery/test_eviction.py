"""Eviction against leases taken at the last moment (no registry: entries are written into the
cache directly): a lease taken after the eviction plan was made, before the removal, keeps its
entry."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path, PurePosixPath

import pytest

from wakegate.control.delivery import cache as cache_module
from wakegate.control.delivery.cache import FILES, Cache, Lease
from wakegate.control.delivery.digests import Digester
from wakegate.control.delivery.errors import CacheFull
from wakegate.control.delivery.index import EntryRecord, EntryUse, EvictionPlan, FileRecord, plan_eviction


async def stored(cache: Cache, name: str, size: int) -> str:
    """A ready entry of `size` random bytes; its key."""
    data = os.urandom(size)
    digester = Digester()
    digester.update(data)
    digests = digester.result()
    async with cache.filling(digests.digest, size) as staging:
        assert staging is not None
        (staging / FILES / name).write_bytes(data)
        record = EntryRecord(
            digests.digest, f"test://{name}", size, time.time(), (FileRecord.of(PurePosixPath(name), digests),)
        )
        cache.commit(staging, record)
    return digests.digest


def test_a_leased_entry_is_not_evicted(tmp_path: Path) -> None:
    cache = Cache(tmp_path / "cache")
    key = asyncio.run(stored(cache, "a.gguf", 1000))
    lease = asyncio.run(cache.lease(key))
    try:
        assert cache._evict(key) is False
        assert cache.record(key) is not None and (cache.files_dir(key) / "a.gguf").exists()
    finally:
        lease.release()
    assert cache._evict(key) is True and cache.record(key) is None


def test_a_lease_taken_between_the_plan_and_the_removal_keeps_its_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = Cache(tmp_path / "cache", max_bytes=3000)
    older = asyncio.run(stored(cache, "older.gguf", 1000))
    newer = asyncio.run(stored(cache, "newer.gguf", 1000))
    now = time.time()
    for key, age in ((older, 100), (newer, 10)):  # last used 100 s and 10 s ago
        lock = cache._lock_path(key, "use")
        lock.touch()
        os.utime(lock, (now - age, now - age))
    leases: list[Lease] = []

    def plan_then_lease(uses: list[EntryUse], budget: int, incoming: int, keep: frozenset[str]) -> EvictionPlan:
        plan = plan_eviction(uses, budget, incoming, keep)
        if not leases:  # a user takes the entry the plan chose, just before it goes
            assert plan.evict == (older,)
            leases.append(asyncio.run(cache.lease(older)))
        return plan

    monkeypatch.setattr(cache_module, "plan_eviction", plan_then_lease)
    try:
        with contextlib.suppress(CacheFull):  # refusing is right too; removing the leased entry is not
            cache.make_room(1500)
        assert cache.record(older) is not None and (cache.files_dir(older) / "older.gguf").read_bytes()
    finally:
        for lease in leases:
            lease.release()
