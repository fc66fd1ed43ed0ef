"""`wakegate up` as a process: invalid files, clean shutdown, crashed children, no orphans."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.http import request
from tests.support.up import UpProcess, model_doc, pids_alive
from wakegate.control.admin import free_port

ONE = model_doc("solo", extra="  aliases: [s]\n")


def child_pids(up: UpProcess) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(up.proc.pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def chat(up: UpProcess) -> int:
    return request(
        "POST",
        f"{up.base_url}/chat/completions",
        body={"model": "s", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
    ).status


def test_invalid_file_fails_before_anything_starts(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(ONE + model_doc("broken", extra="  scaling: {min: 2, max: 1}\n"))
    result = subprocess.run(
        [sys.executable, "-m", "wakegate", "up", "-f", str(bad), "--state-dir", str(tmp_path / "state")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "document 2 (Model 'broken')" in result.stderr and "spec.scaling" in result.stderr
    assert not (tmp_path / "state").exists()


def test_sigterm_stops_every_child(tmp_path: Path) -> None:
    up = UpProcess(tmp_path, ONE)
    try:
        up.wait_ready({"solo": 1})
        assert chat(up) == 200
        children = child_pids(up)
        assert len(children) == 5  # feeder, two extprocs, envoy, one backend
        assert up.stop(signal.SIGTERM) == 0
        assert pids_alive(children) == []
        assert "wakegate up: stopped" in up.log()
    finally:
        up.stop()


def test_crashed_backend_is_restarted(tmp_path: Path) -> None:
    up = UpProcess(tmp_path, ONE)
    try:
        up.wait_ready({"solo": 1})
        (replica,) = up.status()["models"][0]["replicas"]
        os.kill(replica["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            (now,) = up.status()["models"][0]["replicas"]
            if now["restarts"] == 1 and now["state"] == "ready":
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"backend not restarted: {up.status()}")
        assert chat(up) == 200
        assert "replica exited model=solo" in up.log()
    finally:
        assert up.stop() == 0


def test_killed_envoy_is_restarted_and_serves_again(tmp_path: Path) -> None:
    up = UpProcess(tmp_path, ONE)
    try:
        up.wait_ready({"solo": 1})
        os.kill(up.status()["components"]["envoy"]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            envoy = up.status()["components"]["envoy"]
            if envoy["restarts"] == 1 and envoy["running"]:
                try:
                    if chat(up) == 200:
                        break
                except OSError:
                    pass
            time.sleep(0.1)
        else:
            pytest.fail(f"Envoy not back: {up.status()['components']}\n{up.log()}")
        assert up.proc.poll() is None
    finally:
        assert up.stop() == 0


def test_a_crash_loop_past_the_budget_stops_up_with_a_clear_message_and_no_orphans(tmp_path: Path) -> None:
    up = UpProcess(tmp_path, ONE)
    try:
        up.wait_ready({"solo": 1})
        children = child_pids(up)
        killed: set[int] = set()
        deadline = time.monotonic() + 60
        while up.proc.poll() is None and time.monotonic() < deadline:
            try:
                pid = up.status()["components"]["extproc-1"]["pid"]
            except OSError:
                break
            if pid not in killed:
                killed.add(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        up.proc.wait(30)
        assert up.proc.returncode == 1
        assert "extproc-1 exited 6 times within 60s" in up.log()
        assert "wakegate up: stopped: extproc-1 exited 6 times" in up.log()
        assert len(killed) == 6
        assert pids_alive(children) == []
    finally:
        up.stop()


def test_a_taken_port_is_an_error_and_a_non_zero_exit(tmp_path: Path) -> None:
    models = tmp_path / "models.yaml"
    models.write_text(ONE)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["up", "-f", str(models), "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{free_port()}"]
        result = subprocess.run(
            [sys.executable, "-m", "wakegate", *argv, "--state-dir", str(tmp_path / "state")],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "serving on" not in result.stdout


def test_before_serving_requests_get_503_with_retry_after_never_500(tmp_path: Path) -> None:
    port = free_port()
    up = UpProcess(tmp_path, ONE, port=port)
    seen: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 60
        while "serving on" not in up.log() and time.monotonic() < deadline:
            try:
                response = request(
                    "POST",
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    body={"model": "s", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
                    timeout=10,
                )
            except OSError:
                continue  # nothing listens yet: refused, not an error page
            seen[response.status] = seen.get(response.status, 0) + 1
            if response.status == 503:
                assert response.headers.get("retry-after"), response.headers
                assert response.json()["error"]["code"] in (
                    "gateway_unavailable",
                    "gateway_starting",
                    "model_not_ready",
                )
        assert "serving on" in up.log()
        assert set(seen) <= {200, 503}, seen
        assert chat(up) == 200  # announced: a request succeeds
    finally:
        assert up.stop() == 0


def test_sigkilled_up_leaves_no_orphans(tmp_path: Path) -> None:
    up = UpProcess(tmp_path, ONE)
    try:
        up.wait_ready({"solo": 1})
        children = child_pids(up)
        up.proc.kill()
        up.proc.wait(10)
        deadline = time.monotonic() + 10
        while pids_alive(children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pids_alive(children) == []
    finally:
        up.stop()


def test_replicas_get_their_own_gpus_and_are_capped_by_them(tmp_path: Path) -> None:
    import json

    gpus = tmp_path / "gpus.json"
    gpus.write_text(json.dumps({"*": [{"vendor": "nvidia", "arch": "sm90", "total_mb": 81_559}] * 2}))
    up = UpProcess(
        tmp_path,
        model_doc(
            "gpu",
            extra="""  resources: {gpu: {count: 1, vendor: nvidia}}
  scaling: {min: 3, max: 3}
""",
        ),
        "--fake-gpus",
        str(gpus),
    )
    try:
        up.wait_ready({"gpu": 2})
        running = up.status()["models"][0]["replicas"]
        assert len(running) == 2, "two GPUs cap three wanted replicas at two"
        visible = set()
        for replica in running:
            environ = Path(f"/proc/{replica['pid']}/environ").read_bytes().split(b"\0")
            visible |= {e for e in environ if e.startswith(b"CUDA_VISIBLE_DEVICES=")}
        assert visible == {b"CUDA_VISIBLE_DEVICES=0", b"CUDA_VISIBLE_DEVICES=1"}
        assert up.log().count("scale model=gpu") == 1, "one scale-up, capped, and no retry storm"
    finally:
        assert up.stop() == 0
