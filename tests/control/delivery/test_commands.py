"""`wakegate cache` and `wakegate flash-load` as a person runs them, against the real registry."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.tools.registry import start_registry
from tests.control.delivery.conftest import weights
from tests.support import REPO_ROOT
from wakegate.control.admin import free_port
from wakegate.control.delivery.cache import Cache

pytestmark = pytest.mark.usefixtures("registry_bin", "oras_bin")


def wakegate(*argv: str, cache: Path, config: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    flags = ["--cache-dir", str(cache), "--progress", "plain"]
    if config:
        flags += ["--registry-config", str(config)]
    command, *rest = argv
    if command == "cache":
        action, *args = rest
        full = [command, *flags, action, *args]
    else:
        full = [command, *rest, *flags]
    return subprocess.run(
        [sys.executable, "-m", "wakegate", *full], capture_output=True, text=True, env=env, timeout=120
    )


def test_push_pull_ls_rm_and_flash_load_from_the_command_line(tmp_path: Path) -> None:
    model = weights(tmp_path / "src", 6 * 1024 * 1024)
    cache_dir = tmp_path / "cache"
    with start_registry(tmp_path / "reg", auth=True) as reg:
        ref = f"oci://{reg.host}/models/tiny:v1"
        pushed = wakegate("cache", "push", str(model), ref, cache=cache_dir, config=reg.docker_config)
        assert pushed.returncode == 0, pushed.stderr
        pinned = pushed.stdout.strip()
        assert re.fullmatch(rf"oci://{re.escape(reg.host)}/models/tiny@sha256:[0-9a-f]{{64}}", pinned)
        assert re.search(r"^pushing .* 6\.3 MB / 6\.3 MB \(100%\)|^ready .*6\.3 MB", pushed.stderr, re.M)

        pulled = wakegate("cache", "pull", ref, cache=cache_dir, config=reg.docker_config)
        assert pulled.returncode == 0, pulled.stderr
        path = Path(pulled.stdout.strip())
        assert path.read_bytes() == model.read_bytes()
        lines = pulled.stderr.splitlines()
        assert any(line.startswith(f"pulling {ref} ") for line in lines)
        assert lines[-1].startswith(f"ready {ref} 6.3 MB / 6.3 MB (100%)") and "MB/s" in lines[-1]

        key = pinned.rpartition("@")[2]
        listed = [json.loads(line) for line in wakegate("cache", "ls", "--json", cache=cache_dir).stdout.splitlines()]
        assert [(e["key"], e["source"], e["inUse"]) for e in listed] == [(key, ref, False)]
        assert "1 entries, 6.3 MB" in wakegate("cache", "ls", cache=cache_dir).stdout

        staged = wakegate(
            "flash-load", key, str(tmp_path / "shm"), "--threads", "2", "--chunk-size", "1M", cache=cache_dir
        )
        assert staged.returncode == 0, staged.stderr
        assert Path(staged.stdout.strip()).read_bytes() == model.read_bytes()
        assert re.search(r"wakegate flash-load: 6\.3 MB in [\d.]+s, [\d.]+ [kMG]B/s", staged.stderr)

        async def hold() -> None:
            lease = await Cache(cache_dir).lease(key)
            try:
                busy = await asyncio.to_thread(wakegate, "cache", "rm", key[:19], cache=cache_dir)
                assert busy.returncode == 1 and "is in use" in busy.stderr
                listed = json.loads(wakegate("cache", "ls", "--json", cache=cache_dir).stdout.splitlines()[0])
                assert listed["inUse"] is True
            finally:
                lease.release()

        asyncio.run(hold())
        removed = wakegate("cache", "rm", ref, cache=cache_dir)
        assert removed.returncode == 0 and removed.stdout.strip() == f"removed {key}"
        assert Cache(cache_dir).keys() == []


def test_mistakes_and_failures_are_one_line_without_a_traceback(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    bad = wakegate("cache", "pull", "oci://no-registry/x", cache=cache_dir)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("wakegate cache: oci://no-registry/x")
    down = wakegate("cache", "pull", f"oci://127.0.0.1:{free_port()}/models/tiny:v1", cache=cache_dir)
    assert down.returncode == 1 and "is unreachable" in down.stderr and "Traceback" not in down.stderr
    missing = wakegate("flash-load", "sha256:" + "1" * 64, str(tmp_path / "shm"), cache=cache_dir)
    assert missing.returncode == 1 and "is not in the cache" in missing.stderr
    chunk = wakegate("flash-load", "sha256:" + "1" * 64, "--chunk-size", "1000", cache=cache_dir)
    assert chunk.returncode == 2 and "multiple of 4096" in chunk.stderr
    nowhere = wakegate("flash-load", str(tmp_path / "no-such-model"), cache=cache_dir)
    assert nowhere.returncode == 2 and "nor an existing path" in nowhere.stderr and "Traceback" not in nowhere.stderr
    typo = wakegate("flash-load", "sha256:12", cache=cache_dir)
    assert typo.returncode == 2 and "is not a digest" in typo.stderr


def test_flash_load_takes_a_plain_path(tmp_path: Path) -> None:
    """A model on local disk is staged by its path, as its `file://` source would be."""
    model = weights(tmp_path / "src", 1024 * 1024)
    staged = wakegate("flash-load", str(model), str(tmp_path / "shm"), cache=tmp_path / "cache")
    assert staged.returncode == 0, staged.stderr
    copy = Path(staged.stdout.strip())
    assert copy.is_relative_to(tmp_path / "shm") and copy.read_bytes() == model.read_bytes()
    assert "wakegate flash-load:" in staged.stderr
