"""The cache's pure decisions: eviction order and what counts as a ready marker."""

from __future__ import annotations

import hashlib
from pathlib import PurePosixPath

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wakegate.control.delivery.digests import Digester, block_ranges
from wakegate.control.delivery.errors import DigestMismatch, MarkerError
from wakegate.control.delivery.index import EntryRecord, EntryUse, FileRecord, plan_eviction, primary_file


def key(n: int) -> str:
    return "sha256:" + hashlib.sha256(str(n).encode()).hexdigest()


def test_least_recently_used_entries_go_first_and_only_as_many_as_needed() -> None:
    entries = [
        EntryUse(key(1), 40, last_used=10, in_use=False),
        EntryUse(key(2), 40, last_used=5, in_use=False),
        EntryUse(key(3), 40, last_used=1, in_use=True),
    ]
    plan = plan_eviction(entries, budget=130, incoming=30)
    assert plan.evict == (key(2),) and plan.fits


def test_an_entry_in_use_is_never_evicted_even_when_nothing_then_fits() -> None:
    entries = [EntryUse(key(1), 60, last_used=1, in_use=True), EntryUse(key(2), 30, last_used=2, in_use=False)]
    plan = plan_eviction(entries, budget=100, incoming=50)
    assert plan.evict == () and not plan.fits and plan.in_use_bytes == 60


@given(
    st.lists(st.tuples(st.integers(1, 100), st.floats(0, 100), st.booleans()), max_size=12),
    st.integers(0, 600),
    st.integers(0, 100),
)
def test_eviction_keeps_leased_entries_and_fits_when_it_says_so(
    spec: list[tuple[int, float, bool]], budget: int, incoming: int
) -> None:
    entries = [EntryUse(key(i), size, used, busy) for i, (size, used, busy) in enumerate(spec)]
    plan = plan_eviction(entries, budget, incoming)
    busy = {e.key for e in entries if e.in_use}
    assert not busy & set(plan.evict)
    left = sum(e.size for e in entries if e.key not in plan.evict) + incoming
    assert plan.fits == (left <= budget)
    if plan.fits and plan.evict:
        kept_idle = [e for e in entries if not e.in_use and e.key not in plan.evict]
        assert all(e.last_used >= max(x.last_used for x in entries if x.key in plan.evict) for e in kept_idle)


def test_the_marker_round_trips_and_a_doctored_one_is_refused() -> None:
    digester = Digester(block_size=4)
    digester.update(b"0123456789")
    digests = digester.verify("sha256:" + hashlib.sha256(b"0123456789").hexdigest(), "x")
    assert digests.blocks == tuple(hashlib.sha256(b).hexdigest() for b in (b"0123", b"4567", b"89"))
    assert list(block_ranges(10, 4)) == [(0, 4), (4, 4), (8, 2)]
    record = EntryRecord(key(1), "oci://r.io/m:v1", 10, 1.5, (FileRecord.of(PurePosixPath("m.gguf"), digests),))
    assert EntryRecord.from_json(record.to_json(), key(1)) == record
    assert record.primary == "m.gguf"
    with pytest.raises(MarkerError, match="names"):
        EntryRecord.from_json(record.to_json(), key(2))
    with pytest.raises(MarkerError):
        EntryRecord.from_json(record.to_json().replace(b'"size": 10', b'"size": 11', 1), key(1))
    with pytest.raises(MarkerError):
        EntryRecord.from_json(record.to_json().replace(b"m.gguf", b"../m.gguf"), key(1))
    with pytest.raises(DigestMismatch, match="expected"):
        digester.verify("sha256:" + "0" * 64, "m.gguf")


def test_the_primary_file_is_the_only_weight_or_the_first_shard() -> None:
    assert primary_file(["tokenizer.json", "model.gguf"]) == "model.gguf"
    assert primary_file(["m-00002-of-00002.gguf", "m-00001-of-00002.gguf"]) == "m-00001-of-00002.gguf"
    assert primary_file(["a.safetensors", "b.safetensors", "config.json"]) is None
