"""`wakegate up`'s weights (control/up/weights.py) against the real registry: one cache for every
model, a check before each start, progress kept for /status, a lease an engine process holds,
and flash copies staged once and swept when the cache lets their entry go."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from e2e.hfmodel import write_model as write_hf_model
from e2e.tools.registry import Registry, start_registry
from tests.control.delivery.conftest import weights
from tests.support.http import request
from tests.support.tools import registry_bin
from tests.support.up import UpProcess, model_doc
from wakegate.control.delivery.errors import DeliveryError
from wakegate.control.delivery.pushing import push
from wakegate.control.delivery.registry import RegistrySettings
from wakegate.control.delivery.resolver import Access
from wakegate.control.manifests import parse_models
from wakegate.control.schema import Model
from wakegate.control.up.weights import Delivery, DeliveryConfig, WeightsWatch

__all__ = ["registry_bin"]
pytestmark = pytest.mark.usefixtures("registry_bin")

MB = 1024 * 1024


def model(name: str, source: str, flash: bool = False) -> Model:
    cache = "  cache: {flash: true}\n" if flash else ""
    (parsed,) = parse_models(
        f"apiVersion: wakegate.io/v1alpha1\nkind: Model\nmetadata: {{name: {name}}}\n"
        f"spec:\n  backend: llamacpp\n  source: {source}\n{cache}"
    )
    return parsed


def publish(reg: Registry, path: Path, tag: str = "v1") -> str:
    ref = f"oci://{reg.host}/models/tiny:{tag}"
    asyncio.run(push(path, ref, settings=RegistrySettings(docker_config=reg.docker_config)))
    return ref


def blob_gets(reg: Registry, path: Path) -> int:
    """GETs of the weight file's own blob (its layer digest is the file's SHA-256)."""
    digest = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    return sum(1 for r in reg.requests() if r.startswith("GET ") and r.endswith(f"/blobs/{digest}"))


def delivery(tmp: Path) -> Delivery:
    return Delivery(DeliveryConfig(cache_dir=tmp / "cache", flash_dir=tmp / "flash"), Access())


@dataclass
class Published:
    """A file of `size` random bytes in a registry, and one model's delivery of it."""

    reg: Registry
    file: Path
    ref: str
    up: Delivery
    watch: WeightsWatch


@contextmanager
def published(tmp: Path, size: int) -> Iterator[Published]:
    file = weights(tmp / "src", size)
    with start_registry(tmp / "reg", access_log=True) as reg:
        ref = publish(reg, file)
        yield Published(reg, file, ref, delivery(tmp), WeightsWatch("m", ref))


def test_models_naming_one_digest_share_one_entry_and_one_pull(tmp_path: Path) -> None:
    file = weights(tmp_path / "src", 6 * MB + 5)
    with start_registry(tmp_path / "reg", access_log=True) as reg:
        by_tag = publish(reg, file)
        digest = publish(reg, file, "also")  # the same bytes under another tag: the same manifest
        up = delivery(tmp_path)

        async def main() -> None:
            a, b = WeightsWatch("a", by_tag), WeightsWatch("b", digest)
            first = await up.acquire(model("a", by_tag), a, base_dir=None, needs_file=True)
            second = await up.acquire(model("b", digest), b, base_dir=None, needs_file=True)
            assert first.path == second.path and first.path.read_bytes() == file.read_bytes()
            assert up.cache.keys() == [a.entry] and a.entry == b.entry
            assert (a.pulls, b.pulls) == (1, 0)
            progress = a.status()["progress"]
            assert progress["phase"] == "ready" and progress["total_bytes"] == 6 * MB + 5
            for got in (first, second):
                got.release()

        asyncio.run(main())
        assert blob_gets(reg, file) == 1


def test_a_corrupt_entry_is_counted_and_fetched_again_and_the_lease_goes_to_a_child(tmp_path: Path) -> None:
    with published(tmp_path, 5 * MB) as p:
        reg, file, ref, up, watch = p.reg, p.file, p.ref, p.up, p.watch
        pulled: list[int] = []
        watch.on_pulled = lambda size, _seconds: pulled.append(size)

        async def start() -> subprocess.Popen[bytes]:
            got = await up.acquire(model("m", ref), watch, base_dir=None, needs_file=True)
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=got.fds)
            got.release()  # ours goes; the child's copy of the lease stays
            return child

        child = asyncio.run(start())
        try:
            (key,) = up.cache.keys()
            assert up.cache.in_use(key)
            assert not up.cache.remove(key)  # in use: refused
        finally:
            child.kill()
            child.wait()
        assert not up.cache.in_use(key)
        cached = up.cache.files_dir(key) / "tiny.gguf"
        with open(cached, "r+b") as f:
            f.seek(2 * MB)
            f.write(b"\0" * 16)
        again = asyncio.run(start())
        again.kill()
        again.wait()
        assert watch.corrupt == 1 and "block 0" in watch.last_corrupt
        assert watch.status()["corrupt_found"] == 1 and watch.pulls == 2 and pulled == [5 * MB, 5 * MB]
        assert cached.read_bytes() == file.read_bytes()
        assert blob_gets(reg, file) == 2


def test_a_registry_that_is_down_is_a_delivery_error_in_the_status(tmp_path: Path) -> None:
    with start_registry(tmp_path / "reg") as reg:
        host = reg.host
    source = f"oci://{host}/models/tiny:v1"
    watch = WeightsWatch("m", source)
    with pytest.raises(DeliveryError) as failed:
        asyncio.run(delivery(tmp_path).acquire(model("m", source), watch, base_dir=None, needs_file=True))
    assert failed.value.reason == "unreachable"
    error = watch.status()["error"]
    assert error["reason"] == "unreachable" and host in error["message"] and "unreachable" in error["message"]
    assert watch.status()["progress"]["phase"] == "failed"


def test_flash_stages_once_reuses_the_copy_and_sweeps_what_the_cache_dropped(tmp_path: Path) -> None:
    with published(tmp_path, 3 * MB + 1) as p:
        file, ref, up, watch = p.file, p.ref, p.up, p.watch

        async def start() -> Path:
            got = await up.acquire(model("m", ref, flash=True), watch, base_dir=None, needs_file=True)
            got.release()
            assert got.staged is not None and got.path == got.staged / "tiny.gguf"
            return got.path

        staged = asyncio.run(start())
        assert staged.is_relative_to(tmp_path / "flash") and staged.read_bytes() == file.read_bytes()
        assert watch.status()["staged"] == str(staged.parent)
        first = os.stat(staged).st_ino
        assert asyncio.run(start()) == staged and os.stat(staged).st_ino == first  # not copied again
        assert "already staged" in watch.progress.detail  # type: ignore[union-attr]
        (key,) = up.cache.keys()
        assert up.cache.remove(key)
        assert up.sweep_flash() == [key] and not staged.parent.exists()


@pytest.mark.parametrize("minimum", [0, 1])
def test_up_answers_held_requests_weights_unavailable_when_the_registry_is_down(tmp_path: Path, minimum: int) -> None:
    """Through the real gateway, with the simulator as the engine (it never reads the weights).
    Each start attempt is retried with backoff while the activation has time; then the held
    requests get the last reason. A scale-from-zero model stops there, an always-on one keeps
    trying in a new activation."""
    with start_registry(tmp_path / "reg") as reg:
        ref = publish(reg, weights(tmp_path / "src", MB))
    timeout = 6
    scaling = f"{{min: {minimum}, max: 1, activationTimeout: {timeout}}}"
    doc = model_doc("gone", extra=f"  source: {ref}\n  scaling: {scaling}\n")
    up = UpProcess(tmp_path, doc, "--cache-dir", str(tmp_path / "cache"))
    try:
        up.wait_ready({"gone": 0})
        body = {"model": "gone", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        started = time.monotonic()
        reply = request("POST", f"{up.base_url}/chat/completions", body=body, timeout=40)
        # An always-on model's activation began when `up` did, a moment before the request.
        assert (0 if minimum else timeout - 1.5) <= time.monotonic() - started <= timeout + 3
        assert reply.status == 503 and reply.headers["retry-after"]
        error = reply.json()["error"]
        assert error["code"] == "weights_unavailable"
        assert error["message"].startswith(f"model 'gone' cannot get its weights: weights unavailable: {ref}")
        (status,) = up.status()["models"]
        assert status["last_failure_code"] == "weights_unavailable" and status["failed_activations"] >= 1
        assert status["failed_start_attempts"] >= 2 and "unavailable" in status["last_attempt_failure"]
        assert status["delivery"]["error"]["reason"] == "unreachable"
        assert "activation failed model=gone failures=1 code=weights_unavailable" in up.log()
        assert [r["state"] for r in status["replicas"]] in ([["restarting"], ["starting"]] if minimum else [[]])
    finally:
        assert up.stop() == 0, up.log()


def test_flash_finds_a_corrupt_entry_while_staging_and_fetches_it_again(tmp_path: Path) -> None:
    with published(tmp_path, 2 * MB) as p:
        reg, file, ref, up, watch = p.reg, p.file, p.ref, p.up, p.watch
        asyncio.run(up.acquire(model("m", ref, flash=True), watch, base_dir=None, needs_file=True)).release()
        (key,) = up.cache.keys()
        with open(up.cache.files_dir(key) / "tiny.gguf", "r+b") as f:
            f.write(b"\xff" * 8)
        staged = asyncio.run(up.acquire(model("m", ref, flash=True), watch, base_dir=None, needs_file=True))
        staged.release()
        assert watch.corrupt == 0  # the staged copy was good and is what the engine loads: nothing read
        for child in (tmp_path / "flash").iterdir():
            for f in child.iterdir():
                f.unlink()
        again = asyncio.run(up.acquire(model("m", ref, flash=True), watch, base_dir=None, needs_file=True))
        again.release()
        assert watch.corrupt == 1 and "does not match its digest" in watch.last_corrupt
        assert again.path.read_bytes() == file.read_bytes() and blob_gets(reg, file) == 2


def test_an_engine_that_loads_a_folder_gets_the_pulled_folder(tmp_path: Path) -> None:
    """A Hugging Face folder pushed as one artifact (config, tokenizer, one safetensors): vLLM
    is given the entry's folder, plain or flash-staged, never the single weight file in it."""
    folder = write_hf_model(tmp_path / "src" / "tiny-hf")
    with start_registry(tmp_path / "reg") as reg:
        ref = publish(reg, folder)
        up = delivery(tmp_path)

        async def main(flash: bool) -> None:
            watch = WeightsWatch("m", ref)
            got = await up.acquire(model("m", ref, flash=flash), watch, base_dir=None, needs_file=False, folder=True)
            try:
                assert got.path.is_dir() and got.path == got.folder
                assert got.path == (got.staged if flash else up.cache.files_dir(watch.entry))  # type: ignore[arg-type]
                for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
                    assert (got.path / name).read_bytes() == (folder / name).read_bytes(), name
            finally:
                got.release()

        asyncio.run(main(flash=False))
        asyncio.run(main(flash=True))
