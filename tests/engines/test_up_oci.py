"""`wakegate up` serving llama-server Models whose weights come from a real OCI registry: pulled
once into the machine's cache on the first wake (progress in the log and /status), served, asleep
when idle, woken again from the cache; two Models naming one digest share one entry; a corrupt
entry is found and fetched again; a registry that is down or never answers fails the held
requests with `weights_unavailable` when their activationTimeout is up (each failed pull is
retried meanwhile); credentials stay out of logs, /status and argv."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from e2e.tools.registry import Registry, start_registry
from tests.engines.conftest import PROMPT, TinyFiles
from tests.engines.test_up_engines import engines_path, model_status, wait_for
from tests.support.http import Response, request
from tests.support.throttle import Throttle
from tests.support.tools import registry_bin
from tests.support.up import UpProcess, pids_alive
from wakegate.control.delivery.pushing import push
from wakegate.control.delivery.registry import RegistrySettings

__all__ = ["registry_bin"]
pytestmark = pytest.mark.usefixtures("registry_bin")

#: A pull of the ~700 kB model through the throttle takes about 2.5 s: long enough to watch.
RATE = 256 * 1024


def model_doc(name: str, source: str, activation_timeout: int = 60, extra: str = "") -> str:
    return f"""---
apiVersion: wakegate.io/v1alpha1
kind: Model
metadata: {{name: {name}}}
spec:
  backend: llamacpp
  source: {source}
  args: [--threads, "1", --ctx-size, "512"]
  scaling: {{min: 0, max: 1, idleTimeout: 2, activationTimeout: {activation_timeout}}}
{extra}"""


def publish(reg: Registry, path: Path, ref: str) -> str:
    """Push with the project's own `wakegate cache push` code; returns the manifest digest."""
    return asyncio.run(push(path, ref, settings=RegistrySettings(docker_config=reg.docker_config)))


def blob_gets(reg: Registry, path: Path) -> int:
    digest = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    return sum(1 for r in reg.requests() if r.startswith("GET ") and r.endswith(f"/blobs/{digest}"))


def chat(up: UpProcess, model: str, timeout: float = 60) -> Response:
    body = {"model": model, "messages": PROMPT, "max_tokens": 4, "temperature": 0}
    return request("POST", f"{up.base_url}/chat/completions", body=body, timeout=timeout)


def engine_pids(up: UpProcess, key: str) -> list[int]:
    return [int(r["pid"]) for r in model_status(up, key)["replicas"] if r["pid"]]  # type: ignore[union-attr]


def asleep(up: UpProcess, key: str, pids: list[int]) -> None:
    """Wait until `key` scaled to zero and its engine processes `pids` are gone (a request sent
    while one still runs could reach it)."""
    assert pids
    wait_for(lambda: model_status(up, key)["replicas"] == [] and pids_alive(pids) == [], 30, f"{key} to sleep")


def delivery(up: UpProcess, key: str) -> dict[str, Any]:
    status = model_status(up, key)["delivery"]
    assert isinstance(status, dict)
    return status


@dataclass
class Fleet:
    up: UpProcess
    reg: Registry
    model: Path
    cache: Path
    flash: Path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny: TinyFiles, llama_server_bin: Path) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("up-oci")
    with start_registry(tmp / "reg", access_log=True) as reg, Throttle(reg.host, RATE) as slow:
        digest = publish(reg, tiny.model, f"oci://{reg.host}/models/tiny:v1")
        with start_registry(tmp / "gone") as gone:  # a registry holding the model, then down
            publish(gone, tiny.model, f"oci://{gone.host}/models/tiny:v1")
            down = gone.host
        stalled = socket.create_server(("127.0.0.1", 0))  # connects, never answers
        fleet_doc = (
            model_doc("tiny", f"oci://{slow.host}/models/tiny:v1")
            + model_doc("pinned", f"oci://{slow.host}/models/tiny@{digest}")
            + model_doc("flashy", f"oci://{slow.host}/models/tiny:v1", extra="  cache: {flash: true}\n")
            + model_doc("offline", f"oci://{down}/models/tiny:v1", activation_timeout=6)
            + model_doc("stalled", f"oci://127.0.0.1:{stalled.getsockname()[1]}/models/tiny:v1", activation_timeout=4)
        )
        cache = tmp / "cache"
        up = UpProcess(
            tmp,
            fleet_doc,
            "--cache-dir",
            str(cache),
            "--flash-dir",
            str(tmp / "flash"),
            env={**engines_path(llama_server_bin), "DOCKER_CONFIG": str(tmp / "no-docker")},
        )
        try:
            up.wait_ready({"tiny": 0, "pinned": 0}, timeout=60)
            yield Fleet(up, reg, tiny.model, cache, tmp / "flash")
        finally:
            stalled.close()
            assert up.stop() == 0, up.log()


def test_wakes_pulls_once_serves_sleeps_and_wakes_from_the_cache(fleet: Fleet) -> None:
    up, reg = fleet.up, fleet.reg
    assert blob_gets(reg, fleet.model) == 0  # nothing is pulled before a request wants it
    seen: list[dict[str, Any]] = []
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            progress = delivery(up, "tiny")["progress"]
            if progress is not None:
                seen.append(progress)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        reply = chat(up, "tiny")
    finally:
        watching.set()
        watcher.join()
    assert reply.status == 200, reply.text
    pids = engine_pids(up, "tiny")
    assert reply.json()["choices"][0]["message"]["content"]
    assert blob_gets(reg, fleet.model) == 1
    # While it pulled, /status showed bytes, the total, a rate and an ETA; the source has no secret.
    pulling = [p for p in seen if p["phase"] == "pulling" and 0 < p["done_bytes"] < p["total_bytes"]]
    assert pulling, seen
    size = fleet.model.stat().st_size
    assert pulling[-1]["total_bytes"] == size and pulling[-1]["rate_bytes_per_second"] > 0
    assert pulling[-1]["eta_seconds"] is not None and "pulling oci://127.0.0.1:" in pulling[-1]["line"]
    after = delivery(up, "tiny")
    assert after["progress"]["phase"] == "ready" and after["pulls"] == 1 and after["error"] is None
    entry = after["entry"]
    assert after["path"] == str(fleet.cache / "entries" / entry.replace(":", "-") / "files" / "tiny.gguf")
    timeline = model_status(up, "tiny")["last_cold_start"]
    assert isinstance(timeline, dict)
    assert 2.0 < timeline["weights"] <= timeline["process_start"] < timeline["ready"]  # the throttled pull came first
    log = up.log()
    assert "weights model=tiny pulling oci://" in log and "weights model=tiny ready" in log
    assert "weights pulled model=tiny bytes=" in log

    # Idle: the engine goes; the next request wakes it from the cache, checked, not pulled.
    asleep(up, "tiny", pids)
    again = chat(up, "tiny")
    assert again.status == 200, again.text
    assert blob_gets(reg, fleet.model) == 1
    assert delivery(up, "tiny")["pulls"] == 1
    assert "weights model=tiny verifying" in up.log()

    # A second Model naming the same artifact by digest: the same entry, no pull of its own.
    pinned = chat(up, "pinned")
    assert pinned.status == 200, pinned.text
    assert blob_gets(reg, fleet.model) == 1
    assert delivery(up, "pinned")["entry"] == entry and delivery(up, "pinned")["pulls"] == 0
    assert [p.name for p in (fleet.cache / "entries").iterdir()] == [entry.replace(":", "-")]
    # The engine holds the entry's lease itself (an inherited descriptor of its lock file).
    (replica,) = model_status(up, "pinned")["replicas"]  # type: ignore[misc]
    held = {str(p.readlink()) for p in Path(f"/proc/{replica['pid']}/fd").iterdir()}
    assert str(fleet.cache / "locks" / f"{entry.replace(':', '-')}.use") in held
    metrics = request("GET", f"http://127.0.0.1:{up.admin_port}/metrics").text
    assert f'wakegate_weights_pulled_bytes_total{{model="tiny"}} {float(size)}' in metrics
    assert 'wakegate_weights_pull_seconds_count{model="tiny"} 1.0' in metrics


def test_a_corrupt_cached_file_is_found_and_fetched_again(fleet: Fleet) -> None:
    up, reg = fleet.up, fleet.reg
    assert chat(up, "tiny").status == 200  # cached (by the test before, or now)
    pids = engine_pids(up, "tiny")
    entry = delivery(up, "tiny")["entry"]
    asleep(up, "tiny", pids)
    gets = blob_gets(reg, fleet.model)
    cached = fleet.cache / "entries" / entry.replace(":", "-") / "files" / "tiny.gguf"
    with open(cached, "r+b") as f:  # one byte flipped, the size unchanged
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    reply = chat(up, "tiny")
    assert reply.status == 200, reply.text
    assert blob_gets(reg, fleet.model) == gets + 1
    assert cached.read_bytes() == fleet.model.read_bytes()
    status = delivery(up, "tiny")
    assert status["corrupt_found"] == 1 and "tiny.gguf: block 0" in status["last_corrupt"]
    assert f"weights model=tiny corrupt oci://{up_source(up, 'tiny')} {entry}: tiny.gguf: block 0" in up.log()
    metrics = request("GET", f"http://127.0.0.1:{up.admin_port}/metrics").text
    assert 'wakegate_weights_corrupt_total{model="tiny"} 1.0' in metrics


def test_a_flash_model_loads_its_staged_copy_from_tmpfs(fleet: Fleet) -> None:
    reply = chat(fleet.up, "flashy")
    assert reply.status == 200, reply.text
    status = delivery(fleet.up, "flashy")
    staged = fleet.flash / str(status["entry"]).replace(":", "-")
    assert status["staged"] == str(staged) and status["path"] == str(staged / "tiny.gguf")
    assert (staged / "tiny.gguf").read_bytes() == fleet.model.read_bytes()
    (replica,) = model_status(fleet.up, "flashy")["replicas"]  # type: ignore[misc]
    argv = Path(f"/proc/{replica['pid']}/cmdline").read_bytes().split(b"\0")
    assert argv[argv.index(b"--model") + 1] == str(staged / "tiny.gguf").encode()
    assert "weights model=flashy staging oci://" in fleet.up.log()


def up_source(up: UpProcess, key: str) -> str:
    return str(delivery(up, key)["source"]).removeprefix("oci://")


@pytest.mark.parametrize(("key", "reason", "within"), [("offline", "unreachable", 6.0), ("stalled", "timeout", 4.0)])
def test_weights_that_cannot_be_had_fail_the_held_requests_at_their_timeout(
    fleet: Fleet, key: str, reason: str, within: float
) -> None:
    started = time.monotonic()
    reply = chat(fleet.up, key, timeout=30)
    took = time.monotonic() - started
    assert reply.status == 503 and reply.headers.get("retry-after"), reply.text
    error = reply.json()["error"]
    assert error["code"] == "weights_unavailable" and error["type"] == "service_unavailable"
    assert error["message"].startswith(f"model '{key}' cannot get its weights: weights unavailable: oci://")
    # Each failed pull is retried while the activation has time (a registry may come back): the
    # held request hears the last reason when the time is up, not before and not after it.
    assert within * 0.5 < took < within + 5, took
    status = model_status(fleet.up, key)
    assert status["last_failure_code"] == "weights_unavailable" and status["replicas"] == []
    assert status["delivery"]["error"]["reason"] == reason  # type: ignore[index]
    assert status["delivery"]["error"]["message"] in str(status["last_failure"])  # type: ignore[index]


@pytest.mark.parametrize("backend", ["llamacpp", "sim"])
def test_a_private_registry_with_credentials_from_a_docker_config_leaks_them_nowhere(
    tmp_path: Path, tiny: TinyFiles, backend: str, request: pytest.FixtureRequest
) -> None:
    """With the simulator too, so that a machine without llama-server still checks it."""
    path = engines_path(request.getfixturevalue("llama_server_bin")) if backend == "llamacpp" else {}
    with start_registry(tmp_path / "reg", auth=True, access_log=True) as reg:
        assert reg.credentials is not None and reg.docker_config is not None
        publish(reg, tiny.model, f"oci://{reg.host}/models/tiny:v1")
        secrets = {reg.credentials.password, reg.credentials.basic().removeprefix("Basic ")}
        doc = model_doc("private", f"oci://{reg.host}/models/tiny:v1").replace("llamacpp", backend)
        if backend == "sim":
            doc = doc.replace('  args: [--threads, "1", --ctx-size, "512"]\n', "")
        up = UpProcess(
            tmp_path,
            doc,
            "--cache-dir",
            str(tmp_path / "cache"),
            "--registry-config",
            str(reg.docker_config),
            env={**path, "DOCKER_CONFIG": str(tmp_path / "no-docker")},
        )
        try:
            up.wait_ready({"private": 0})
            reply = chat(up, "private")
            assert reply.status == 200, reply.text
            assert blob_gets(reg, tiny.model) == 1
            status = up.status()
            pids = [c["pid"] for c in status["components"].values()]
            pids += [r["pid"] for m in status["models"] for r in m["replicas"]]
            argv = [Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace") for pid in pids]
            texts = {"/status": json.dumps(status), "argv": "\n".join(argv), "up log": up.log()}
            for log in (up.state_dir / "logs").glob("*.log"):
                texts[log.name] = log.read_text(errors="replace")
            for marker in (tmp_path / "cache").rglob("*.json"):
                texts[marker.name] = marker.read_text()
            leaks = [where for where, text in texts.items() for secret in secrets if secret in text]
            assert leaks == []
            assert len(texts) > 5  # the children's logs and the cache's markers were read
        finally:
            assert up.stop() == 0, up.log()
