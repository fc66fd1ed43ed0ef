"""The cache with the real registry: corruption found and fetched again, half-written entries
ignored (and resumed), eviction that never touches a leased entry, and one download shared by
two processes pulling the same digest."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.tools.registry import Registry, start_registry
from tests.control.delivery.conftest import weights
from tests.support import REPO_ROOT
from wakegate.control.delivery.cache import Cache
from wakegate.control.delivery.errors import DeliveryError
from wakegate.control.delivery.progress import Phase, Progress
from wakegate.control.delivery.pushing import push
from wakegate.control.delivery.registry import RegistrySettings
from wakegate.control.delivery.resolver import Access, Resolved, resolve

pytestmark = pytest.mark.usefixtures("registry_bin", "oras_bin")

MB = 1024 * 1024


def publish(reg: Registry, path: Path, name: str) -> tuple[str, str]:
    ref = f"oci://{reg.host}/models/{name}:v1"
    return ref, asyncio.run(push(path, ref, settings=RegistrySettings(docker_config=reg.docker_config)))


def pull(ref: str, cache: Cache, events: list[Progress] | None = None) -> Resolved:
    return asyncio.run(resolve(ref, cache, access=Access(), progress=events.append if events is not None else print))


def layer_gets(reg: Registry) -> list[str]:
    return [r for r in reg.requests() if r.startswith("GET /v2/models/") and "/blobs/" in r]


def test_a_corrupted_entry_is_found_reported_and_fetched_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = weights(tmp_path / "src", 40 * MB + 7)
    cache = Cache(tmp_path / "cache")
    with start_registry(tmp_path / "reg") as reg:
        ref, key = publish(reg, model, "tiny")
        pull(ref, cache).release()
        cached = cache.files_dir(key) / "tiny.gguf"
        with open(cached, "r+b") as f:  # one flipped byte in the second block, size unchanged
            f.seek(33 * MB)
            byte = f.read(1)
            f.seek(33 * MB)
            f.write(bytes([byte[0] ^ 0xFF]))
        events: list[Progress] = []
        with caplog.at_level(logging.WARNING, "wakegate.delivery"):
            resolved = pull(ref, cache, events)
        corrupt = [e for e in events if e.phase is Phase.CORRUPT]
        assert len(corrupt) == 1 and "tiny.gguf: block 1" in corrupt[0].detail
        assert f"{key} is corrupt" in caplog.text
        assert resolved.pulled and resolved.model_path.read_bytes() == model.read_bytes()
        resolved.release()
        os.truncate(cached, 10)  # a truncated file is caught by its size alone
        again = pull(ref, cache)
        assert again.pulled and again.model_path.read_bytes() == model.read_bytes()
        again.release()


def test_a_half_written_entry_is_never_used_and_its_bytes_are_resumed(tmp_path: Path) -> None:
    model = weights(tmp_path / "src", 8 * MB)
    cache = Cache(tmp_path / "cache")
    with start_registry(tmp_path / "reg", access_log=True) as reg:
        ref, key = publish(reg, model, "tiny")
        # A pull that died half way: half the file in its staging directory, and a directory
        # in entries/ without a marker (copied by hand, or from an older version).
        staging = cache.staging_dir(key) / "files"
        staging.mkdir(parents=True)
        (staging / "tiny.gguf").write_bytes(model.read_bytes()[: 4 * MB])
        cache.files_dir(key).mkdir(parents=True)
        (cache.files_dir(key) / "tiny.gguf").write_bytes(b"not the model")
        assert cache.record(key) is None and cache.entries() == []
        events: list[Progress] = []
        resolved = pull(ref, cache, events)
        assert resolved.pulled and resolved.model_path.read_bytes() == model.read_bytes()
        resolved.release()
        pulling = [e.done for e in events if e.phase is Phase.PULLING]
        assert 4 * MB in pulling, pulling  # resumed from the bytes on disk
        gets = layer_gets(reg)
        assert len([g for g in gets if g.endswith(resolved.record.files[0].digest)]) == 1  # type: ignore[union-attr]
        assert not cache.staging_dir(key).exists()


def test_eviction_keeps_leased_entries_and_refuses_when_nothing_can_go(tmp_path: Path) -> None:
    with start_registry(tmp_path / "reg") as reg:
        refs = [publish(reg, weights(tmp_path / f"m{i}", 3 * MB + i), f"m{i}") for i in range(3)]
        cache = Cache(tmp_path / "cache", max_bytes=7 * MB)
        first = pull(refs[0][0], cache)  # leased: kept although least recently used
        second = pull(refs[1][0], cache)
        second.release()
        third = pull(refs[2][0], cache)  # needs room: evicts the second, not the leased first
        assert set(cache.keys()) == {refs[0][1], refs[2][1]}
        assert first.model_path.exists()
        with pytest.raises(DeliveryError) as full:
            pull(refs[1][0], cache)  # both others are leased now
        assert full.value.reason == "cache_full" and "held by entries in use" in str(full.value)
        assert set(cache.keys()) == {refs[0][1], refs[2][1]}
        first.release()
        again = pull(refs[1][0], cache)  # the first is free: it goes
        assert set(cache.keys()) == {refs[1][1], refs[2][1]}
        for resolved in (again, third):
            resolved.release()


def test_two_processes_pulling_one_digest_share_one_download(tmp_path: Path) -> None:
    model = weights(tmp_path / "src", 96 * MB)
    with start_registry(tmp_path / "reg", access_log=True) as reg:
        ref, key = publish(reg, model, "big")
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        argv = [
            sys.executable,
            "-m",
            "wakegate",
            "cache",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--progress",
            "plain",
            "pull",
            ref,
        ]
        procs = [
            subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)
        ]
        outputs = [p.communicate(timeout=120) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outputs
        paths = {out.strip() for out, _ in outputs}
        assert paths == {str(Cache(tmp_path / "cache").files_dir(key) / "tiny.gguf")}
        layer = json.loads((Cache(tmp_path / "cache").entry_dir(key) / "manifest.json").read_text())["layers"][0]
        assert [g for g in layer_gets(reg) if g.endswith(layer["digest"])] == [
            f"GET /v2/models/big/blobs/{layer['digest']}"
        ]
        assert Path(paths.pop()).read_bytes() == model.read_bytes()
