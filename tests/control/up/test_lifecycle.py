"""`wakegate up` as a process: invalid files, clean shutdown, crashed children, no orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.http import request
from tests.support.up import UpProcess, model_doc, pids_alive

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
    up.wait_ready({"solo": 1})
    assert chat(up) == 200
    children = child_pids(up)
    assert len(children) == 3  # extproc, envoy, one backend
    assert up.stop(signal.SIGTERM) == 0
    assert pids_alive(children) == []
    assert "wakegate up: stopped" in up.log()


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


def test_envoy_crash_stops_up_with_an_error_and_no_orphans(tmp_path: Path) -> None:
    up = UpProcess(tmp_path, ONE)
    up.wait_ready({"solo": 1})
    children = child_pids(up)
    # The executable's name: every child's arguments name paths under tmp_path, which says "envoy".
    envoy = [p for p in children if Path(Path(f"/proc/{p}/cmdline").read_text().split("\0")[0]).name == "envoy"]
    os.kill(envoy[0], signal.SIGKILL)
    up.proc.wait(30)
    assert up.proc.returncode == 1
    assert "envoy exited with code" in up.log()
    assert pids_alive(children) == []
    up.stop()


def test_sigkilled_up_leaves_no_orphans(tmp_path: Path) -> None:
    up = UpProcess(tmp_path, ONE)
    up.wait_ready({"solo": 1})
    children = child_pids(up)
    up.proc.kill()
    up.proc.wait(10)
    deadline = time.monotonic() + 10
    while pids_alive(children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pids_alive(children) == []
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
