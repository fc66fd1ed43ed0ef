"""Build Helm from its published Go module into e2e/.bin/helm.

`python -m e2e.helm` compiles the `helm` CLI pinned by e2e/helm/go.mod (a `tool`
directive), like `python -m e2e.build` does for the Kubernetes binaries. A stamp
records a hash of go.mod, go.sum, the Go version and the recipe, so the binary is
rebuilt only when one of them changes. The chart tests (tests/chart/) and the
Helm e2e test (e2e/test_helm.py) call `ensure_helm()`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from e2e.build import BuildError as BuildError
from e2e.build import go_env, go_version, required_version, stamp_matches

HERE = Path(__file__).resolve().parent
BIN_DIR = HERE.parent / ".bin"
BUILD_DIR = HERE.parent / ".build"
HELM = BIN_DIR / "helm"
STAMP = BIN_DIR / "helm-stamp.json"
MODULE = "helm.sh/helm/v3"
PACKAGE = f"{MODULE}/cmd/helm"

#: bump when the way the binary is built changes (flags, env), to force a rebuild
RECIPE = "1"

Log = Callable[[str], None]


def _log(msg: str) -> None:
    print(f"[e2e.helm] {msg}", file=sys.stderr, flush=True)


def pinned_version(module: str) -> str:
    """The version of `module` that e2e/helm/go.mod requires."""
    try:
        return required_version(HERE / "go.mod", module)
    except RuntimeError as exc:
        raise BuildError(str(exc)) from None


def _ldflags() -> str:
    # What Helm's Makefile sets for a release build: the version `helm version`
    # prints, and the Kubernetes version `helm lint`/`template` assume by default
    # (client-go v0.X.Y -> Kubernetes 1.X).
    helm_version = pinned_version(MODULE)
    client_go = pinned_version("k8s.io/client-go").lstrip("v").split(".")
    major, minor = str(int(client_go[0]) + 1), client_go[1]
    flags = ["-s", "-w", f"-X {MODULE}/internal/version.version={helm_version}",
             f"-X {MODULE}/internal/version.gitTreeState=clean"]
    for pkg in ("pkg/lint/rules", "pkg/chartutil"):
        flags += [f"-X {MODULE}/{pkg}.k8sVersionMajor={major}", f"-X {MODULE}/{pkg}.k8sVersionMinor={minor}"]
    return " ".join(flags)


def wanted_stamp() -> dict[str, str | None]:
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum"):
        digest.update((HERE / name).read_bytes())
    return {"go_mod_sum": digest.hexdigest(), "go": go_version(), "recipe": RECIPE}


def is_current() -> bool:
    if not STAMP.exists() or not HELM.exists():
        return False
    return stamp_matches(STAMP, wanted_stamp())


def ensure_helm(force: bool = False, log: Log = _log) -> Path:
    """Build helm unless the stamp says it matches the pins; returns its path."""
    if not force and is_current():
        return HELM
    if shutil.which("go") is None:
        raise BuildError("`go` is not on PATH; the chart tests build Helm from its Go module")
    started = time.monotonic()
    log(f"building helm {pinned_version(MODULE)} with {go_version()} (first build takes minutes)")
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="helm-", dir=BUILD_DIR))
    try:
        cmd = ["nice", "-n", "10", "go", "build", "-ldflags", _ldflags(), "-o", str(staging / "helm"), PACKAGE]
        proc = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, env=go_env())
        if proc.returncode != 0:
            raise BuildError(proc.stderr or f"go build exited {proc.returncode}")
        BIN_DIR.mkdir(parents=True, exist_ok=True)
        os.replace(staging / "helm", HELM)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    STAMP.write_text(json.dumps(wanted_stamp(), indent=2) + "\n")
    log(f"built in {time.monotonic() - started:.0f}s -> {HELM}")
    return HELM
