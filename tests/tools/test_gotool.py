"""The Go tool builder (e2e/tools): build once, reuse while the pins hold, rebuild when one moves.

Exercised on a one-file module made here, so it needs Go but no download."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.tools import TOOLS, BuildError, GoTool
from tests.support.required import missing


@pytest.fixture(autouse=True, scope="module")
def _go_installed() -> None:
    if shutil.which("go") is None:
        missing("needs the Go toolchain")


MAIN = """package main

import "fmt"

var greeting = "unset"

func main() { fmt.Println(greeting) }
"""


#: pinned like the real tools (a `tool` directive over a required module), the module
#: being a local directory instead of a download
PINS = """module example.test/pins

go 1.26.0

tool example.test/hello

require example.test/hello v1.0.0

replace example.test/hello v1.0.0 => ./hello
"""


def hello(tmp: Path, recipe: str = "1", source: str = MAIN) -> GoTool:
    pins = tmp / "pins"
    (pins / "hello").mkdir(parents=True, exist_ok=True)
    if not (pins / "go.mod").exists():
        (pins / "go.mod").write_text(PINS)
        (pins / "go.sum").write_text("")
        (pins / "hello" / "go.mod").write_text("module example.test/hello\n\ngo 1.26.0\n")
    (pins / "hello" / "main.go").write_text(source)
    return GoTool(
        "hello",
        "example.test/hello",
        "example.test/hello",
        lambda tool: "-X main.greeting=pinned",
        pins,
        bin_dir=tmp / "bin",
        recipe=recipe,
    )


def run(binary: Path) -> str:
    return subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout.strip()


def test_builds_with_its_ldflags_then_reuses(tmp_path: Path) -> None:
    logs: list[str] = []
    tool = hello(tmp_path)
    assert not tool.is_current()
    binary = tool.ensure(log=logs.append)
    assert run(binary) == "pinned"
    assert tool.is_current()
    assert any(line.startswith("building hello") for line in logs)
    built_at = binary.stat().st_mtime_ns

    logs.clear()
    assert tool.ensure(log=logs.append) == binary
    assert logs == []
    assert binary.stat().st_mtime_ns == built_at
    assert [p.name for p in tool.bin_dir.iterdir() if p.name.startswith(".hello-")] == [], "staging left behind"


@pytest.mark.parametrize("change", ["go.mod", "recipe"])
def test_a_moved_pin_rebuilds(tmp_path: Path, change: str) -> None:
    tool = hello(tmp_path)
    binary = tool.ensure(log=lambda _: None)
    built_at = binary.stat().st_mtime_ns
    if change == "go.mod":
        with (tool.mod_dir / "go.mod").open("a") as f:
            f.write("// a comment still changes the pins' hash\n")
    else:
        tool = hello(tmp_path, recipe="2")
    assert not tool.is_current()
    logs: list[str] = []
    tool.ensure(log=logs.append)
    assert any(line.startswith("building hello") for line in logs)
    assert binary.stat().st_mtime_ns != built_at
    assert tool.is_current()


def test_a_failed_build_keeps_the_last_good_binary(tmp_path: Path) -> None:
    tool = hello(tmp_path)
    binary = tool.ensure(log=lambda _: None)
    broken = hello(tmp_path, recipe="2", source=MAIN + "\nfunc broken() { undefinedThing() }\n")
    with pytest.raises(BuildError, match="undefinedThing"):
        broken.ensure(log=lambda _: None)
    assert run(binary) == "pinned"
    assert not broken.is_current()


def test_without_go_a_built_tool_is_still_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tool = hello(tmp_path)
    binary = tool.ensure(log=lambda _: None)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert tool.is_current()
    assert tool.ensure(log=lambda _: None) == binary
    binary.unlink()
    with pytest.raises(BuildError, match="`go` is not on PATH"):
        tool.ensure(log=lambda _: None)


def test_cli_prints_each_tool_and_refuses_unknown_names() -> None:
    # h2spec is the smallest pinned tool; built already by the other tests in this folder or by CI.
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run(
        [sys.executable, "-m", "e2e.tools", "h2spec"], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"h2spec: {TOOLS['h2spec'].binary}\n"
    bad = subprocess.run(
        [sys.executable, "-m", "e2e.tools", "h2spec", "nope"], capture_output=True, text=True, env=env, timeout=60
    )
    assert bad.returncode == 2
    assert "unknown tool nope" in bad.stderr
