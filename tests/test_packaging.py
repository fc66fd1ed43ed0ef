"""The installed distribution is one top-level package, `wakegate`: no generic `control` or `extproc`."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.support import REPO_ROOT

#: What a wheel is built from (pyproject.toml's package-dir, packages and data-files).
SOURCES = ("pyproject.toml", "README.md", "control", "extproc", "proto", "envoy")


def build_wheel(tmp: Path) -> Path:
    source = tmp / "src"
    source.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in SOURCES:
        origin = REPO_ROOT / name
        if origin.is_dir():
            shutil.copytree(origin, source / name, symlinks=True, ignore=skip)
        else:
            shutil.copy2(origin, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), "."],
        cwd=source,
        check=True,
        capture_output=True,
    )
    [wheel] = (tmp / "dist").glob("wakegate-*.whl")
    return wheel


def test_the_wheel_installs_only_the_wakegate_package(tmp_path: Path) -> None:
    with zipfile.ZipFile(build_wheel(tmp_path)) as wheel:
        names = wheel.namelist()
        entry_points = next(wheel.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    tops = {name.split("/")[0] for name in names}
    assert {t for t in tops if not t.startswith("wakegate-")} == {"wakegate"}
    assert {
        "wakegate/cli.py",
        "wakegate/control/up/main.py",
        "wakegate/extproc/h2grpc/call.py",
        "wakegate/v1/routing_pb2.py",
        "wakegate/contract.py",
        "wakegate/control/py.typed",
    } <= set(names)
    assert any(n.endswith(".data/data/share/wakegate/envoy/bootstrap.yaml") for n in names)
    assert "wakegate = wakegate.cli:main" in entry_points


def test_the_development_install_exposes_no_top_level_control_or_extproc(tmp_path: Path) -> None:
    for name in ("control", "extproc"):
        found = subprocess.run(
            [sys.executable, "-c", f"import importlib.util; print(importlib.util.find_spec({name!r}))"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
        )
        assert found.stdout.strip() == "None"
    ok = subprocess.run([sys.executable, "-m", "wakegate", "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert ok.returncode == 0 and "scheduler-extender" in ok.stdout
