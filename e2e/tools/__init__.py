"""Command-line tools the tests drive, built from their published Go modules into e2e/.bin.

Each tool is pinned by its own go.mod under e2e/tools/go/NAME (a `tool` directive), so
one tool's dependencies never move another's. `ensure(NAME)` builds a tool, or reuses
it when its stamp (a hash of go.mod and go.sum, the Go version and the recipe) still
matches; `python -m e2e.tools [NAME...]` does the same from a shell and prints
`NAME: PATH` per tool. The Kubernetes binaries (e2e/build.py) share the stamp and
build helpers.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from e2e.build import (
    BIN_DIR,
    BuildError,
    Log,
    go_build,
    go_mod_digest,
    go_version,
    required_version,
    stamp_matches,
)

__all__ = ["TOOLS", "BuildError", "GoTool", "ensure", "path"]

MOD_ROOT = Path(__file__).resolve().parent / "go"


def _log(msg: str) -> None:
    print(f"[e2e.tools] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class GoTool:
    """One binary: the main `package` of `module`, compiled in the module at `mod_dir` into `bin_dir`."""

    name: str
    module: str
    package: str
    #: -ldflags for `go build`, computed from the pins (release builds stamp a version in)
    ldflags: Callable[[GoTool], str]
    #: the go.mod (and go.sum) that pins the tool and its dependencies
    mod_dir: Path
    bin_dir: Path = BIN_DIR
    #: bump when the way the binary is built changes (flags, env), to force a rebuild
    recipe: str = "1"

    @property
    def binary(self) -> Path:
        return self.bin_dir / self.name

    @property
    def stamp(self) -> Path:
        return self.bin_dir / f"{self.name}-stamp.json"

    def version(self, module: str | None = None) -> str:
        """The version of `module` (default: the tool's own) that the tool's go.mod requires."""
        try:
            return required_version(self.mod_dir / "go.mod", module or self.module)
        except RuntimeError as exc:
            raise BuildError(str(exc)) from None

    def wanted_stamp(self) -> dict[str, str | None]:
        return {"go_mod_sum": go_mod_digest(self.mod_dir), "go": go_version(), "recipe": self.recipe}

    def is_current(self) -> bool:
        return self.binary.exists() and self.stamp.exists() and stamp_matches(self.stamp, self.wanted_stamp())

    def ensure(self, force: bool = False, log: Log = _log) -> Path:
        """Build the binary unless its stamp matches the pins; returns its path."""
        if not force and self.is_current():
            return self.binary
        if shutil.which("go") is None:
            raise BuildError(f"`go` is not on PATH; {self.name} is built from its Go module {self.module}")
        self.bin_dir.mkdir(parents=True, exist_ok=True)
        with _locked(self.bin_dir / f".{self.name}.lock"):
            # Another process may have built it while we waited for the lock.
            if not force and self.is_current():
                return self.binary
            started = time.monotonic()
            log(f"building {self.name} {self.version()} ({self.package}) with {go_version()}")
            # Staged beside the binary, so the final rename never crosses file systems.
            staging = Path(tempfile.mkdtemp(prefix=f".{self.name}-", dir=self.bin_dir))
            try:
                go_build([self.package], staging / self.name, self.mod_dir, self.ldflags(self), log)
                os.replace(staging / self.name, self.binary)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            self.stamp.write_text(json.dumps(self.wanted_stamp(), indent=2) + "\n")
            log(f"built {self.name} in {time.monotonic() - started:.0f}s -> {self.binary}")
        return self.binary


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One build of a tool at a time (two test runs may ask for it at once)."""
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _helm_ldflags(tool: GoTool) -> str:
    # What Helm's Makefile sets for a release build: the version `helm version`
    # prints, and the Kubernetes version `helm lint`/`template` assume by default
    # (client-go v0.X.Y -> Kubernetes 1.X).
    client_go = tool.version("k8s.io/client-go").lstrip("v").split(".")
    major, minor = str(int(client_go[0]) + 1), client_go[1]
    flags = ["-s", "-w", f"-X {tool.module}/internal/version.version={tool.version()}",
             f"-X {tool.module}/internal/version.gitTreeState=clean"]
    for pkg in ("pkg/lint/rules", "pkg/chartutil"):
        flags += [f"-X {tool.module}/{pkg}.k8sVersionMajor={major}",
                  f"-X {tool.module}/{pkg}.k8sVersionMinor={minor}"]
    return " ".join(flags)


def _registry_ldflags(tool: GoTool) -> str:
    # `registry --version` then names the pinned release instead of "+unknown".
    return f"-s -w -X {tool.module}/version.version={tool.version()}"


def _oras_ldflags(tool: GoTool) -> str:
    # The release number is in oras' source; its Makefile only adds the tree state.
    return f"-s -w -X {tool.module}/internal/version.GitTreeState=clean"


def _h2spec_ldflags(tool: GoTool) -> str:
    version = tool.version().lstrip("v").removesuffix("+incompatible")
    return f"-s -w -X main.VERSION={version}"


def _pinned(name: str, module: str, main: str, ldflags: Callable[[GoTool], str]) -> GoTool:
    """A tool pinned by e2e/tools/go/NAME/go.mod; `main` is its package inside `module`."""
    return GoTool(name, module, f"{module}/{main}", ldflags, MOD_ROOT / name)


TOOLS: dict[str, GoTool] = {
    tool.name: tool
    for tool in (
        _pinned("helm", "helm.sh/helm/v3", "cmd/helm", _helm_ldflags),
        _pinned("registry", "github.com/distribution/distribution/v3", "cmd/registry", _registry_ldflags),
        _pinned("oras", "oras.land/oras", "cmd/oras", _oras_ldflags),
        _pinned("h2spec", "github.com/summerwind/h2spec", "cmd/h2spec", _h2spec_ldflags),
    )
}


def ensure(name: str, force: bool = False, log: Log = _log) -> Path:
    """Build (or reuse) the tool `name`; returns its binary. Raises BuildError."""
    return TOOLS[name].ensure(force, log)


def path(name: str) -> Path:
    """Where the tool `name` is (or will be) built; it may not exist yet."""
    return TOOLS[name].binary
