"""Build the pinned control-plane binaries from their Go modules into e2e/.bin.

`python -m e2e.build` compiles etcd, kube-apiserver, kube-controller-manager and
kube-scheduler from the versions pinned in e2e/go/go.mod and copies KEDA's CRDs
out of KEDA's Go module. A stamp file records a hash of everything that decides
the output, so a rebuild happens only when a pin changes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
GO_DIR = HERE / "go"
BIN_DIR = HERE / ".bin"
BUILD_DIR = HERE / ".build"
CRD_DIR = BIN_DIR / "crds"
STAMP = BIN_DIR / "stamp.json"

#: KEDA is not part of e2e/go/go.mod on purpose: requiring it there would let its
#: dependencies raise the versions the Kubernetes binaries are compiled against.
KEDA_MODULE = "github.com/kedacore/keda/v2"
KEDA_VERSION = "v2.20.2"
KEDA_CRDS = (
    "keda.sh_scaledobjects.yaml",
    "keda.sh_triggerauthentications.yaml",
    "keda.sh_clustertriggerauthentications.yaml",
    "keda.sh_scaledjobs.yaml",
)

#: binary name -> Go package (main) that builds it
BINARIES: dict[str, str] = {
    "etcd": "go.etcd.io/etcd/server/v3",
    "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
    "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
    "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler",
}

#: bump when the way binaries are built changes (flags, env), to force a rebuild
RECIPE = "1"

Log = Callable[[str], None]


def _log(msg: str) -> None:
    print(f"[e2e.build] {msg}", file=sys.stderr, flush=True)


def required_version(go_mod: Path, module: str) -> str:
    """The version of `module` that the go.mod file `go_mod` requires."""
    # In a require block, or on a line of its own (`go mod tidy` writes that for a single requirement).
    match = re.search(rf"^\s*(?:require\s+)?{re.escape(module)} (v\S+)", go_mod.read_text(), re.MULTILINE)
    if not match:
        raise RuntimeError(f"{module} is not required in {go_mod}")
    return match.group(1)


def pinned_version(module: str) -> str:
    """The version of `module` that e2e/go/go.mod requires."""
    return required_version(GO_DIR / "go.mod", module)


def go_env() -> dict[str, str]:
    env = dict(os.environ)
    # Static binaries, like the release builds; also spares us a C toolchain.
    env["CGO_ENABLED"] = "0"
    return env


def go_version() -> str | None:
    """The Go toolchain's version, None without one (built binaries stay usable)."""
    if shutil.which("go") is None:
        return None
    out = subprocess.run(
        ["go", "env", "GOVERSION"], capture_output=True, text=True, check=True, env=go_env()
    )
    return out.stdout.strip()


def _ldflags() -> str:
    # Without these the servers report v0.0.0-master; clients that look at
    # /version (kubectl, kopf) want a real release number.
    version = pinned_version("k8s.io/kubernetes")
    major, minor = version.lstrip("v").split(".")[:2]
    flags = ["-s", "-w"]
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [
            f"-X {pkg}.gitVersion={version}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
        ]
    return " ".join(flags)


def go_mod_digest(mod_dir: Path) -> str:
    """A hash of the pins in `mod_dir` (go.mod and go.sum), for a build stamp."""
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum"):
        digest.update((mod_dir / name).read_bytes())
    return digest.hexdigest()


def wanted_stamp() -> dict[str, str | None]:
    return {
        "go_mod_sum": go_mod_digest(GO_DIR),
        "go": go_version(),
        "keda": KEDA_VERSION,
        "recipe": RECIPE,
    }


def stamp_matches(stamp: Path, want: dict[str, str | None]) -> bool:
    """`stamp` records a build of exactly `want` (the Kubernetes build and e2e.tools share this)."""
    try:
        have = json.loads(stamp.read_text())
    except (ValueError, OSError):
        return False
    want = dict(want)
    if want["go"] is None:
        # No Go here: binaries built for these pins by any Go will do.
        have.pop("go", None)
        want.pop("go")
    return bool(have == want)


def build_cli(
    argv: list[str] | None,
    prog: str,
    description: str,
    product: Path,
    stamp: Path,
    is_current: Callable[[], bool],
    ensure: Callable[..., Path],
    log: Log,
) -> int:
    """`python -m e2e.build` and `python -m e2e.helm`: build or reuse, `--force` rebuilds."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--force", action="store_true", help="rebuild even if the stamp matches")
    args = parser.parse_args(argv)
    if not args.force and is_current():
        log(f"up to date: {product} (delete {stamp} or pass --force to rebuild)")
        return 0
    try:
        ensure(force=True)
    except BuildError as exc:
        log(f"build failed:\n{exc}")
        return 1
    return 0


def is_current() -> bool:
    if not STAMP.exists() or not all((BIN_DIR / name).exists() for name in BINARIES):
        return False
    if not all((CRD_DIR / name).exists() for name in KEDA_CRDS):
        return False
    return stamp_matches(STAMP, wanted_stamp())


def go_build(packages: list[str], out: Path, mod_dir: Path, ldflags: str, log: Log) -> None:
    """`go build -v` in the module `mod_dir`, with a progress line every 15 s (a first build takes minutes)."""
    listing = subprocess.run(
        ["go", "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", *packages],
        cwd=mod_dir, capture_output=True, text=True, env=go_env(),
    )
    if listing.returncode != 0:
        raise BuildError(listing.stderr)
    total = len([line for line in listing.stdout.splitlines() if line])
    cmd = ["nice", "-n", "10", "go", "build", "-v", "-ldflags", ldflags, "-o", str(out), *packages]
    proc = subprocess.Popen(cmd, cwd=mod_dir, stderr=subprocess.PIPE, text=True, env=go_env())
    assert proc.stderr is not None
    compiled = 0
    errors: list[str] = []
    started = last = time.monotonic()
    done = threading.Event()

    def ticker() -> None:
        # -v prints nothing while the big packages compile or while linking,
        # so a clock keeps the log alive.
        while not done.wait(15):
            log(f"  ... {compiled}/{total} packages compiled, {time.monotonic() - started:.0f}s")

    threading.Thread(target=ticker, daemon=True).start()
    try:
        for line in proc.stderr:
            line = line.rstrip()
            # -v prints bare import paths; anything else is an error or a note.
            if re.fullmatch(r"[\w.\-/~]+", line):
                # A cold cache also prints the standard library, which `total` leaves out.
                if "." not in line.split("/", 1)[0]:
                    continue
                compiled += 1
                if time.monotonic() - last > 30:
                    last = time.monotonic()
                    log(f"  ... {compiled}/{total} packages compiled (last: {line})")
            elif line.startswith("go: downloading"):
                log(f"  {line}")
            else:
                errors.append(line)
        code = proc.wait()
    finally:
        done.set()
        proc.stderr.close()
    if code != 0:
        raise BuildError("\n".join(errors) or f"go build exited {code}")


def _copy_keda_crds(log: Log) -> None:
    log(f"fetching KEDA CRDs from {KEDA_MODULE}@{KEDA_VERSION}")
    # Outside any module, so the download cannot touch e2e/go/go.sum.
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            ["go", "mod", "download", "-json", f"{KEDA_MODULE}@{KEDA_VERSION}"],
            cwd=tmp, capture_output=True, text=True, env={**go_env(), "GOFLAGS": "-mod=mod"},
        )
    if out.returncode != 0:
        raise BuildError(out.stdout + out.stderr)
    src = Path(json.loads(out.stdout)["Dir"]) / "config" / "crd" / "bases"
    CRD_DIR.mkdir(parents=True, exist_ok=True)
    for name in KEDA_CRDS:
        shutil.copyfile(src / name, CRD_DIR / name)


class BuildError(RuntimeError):
    pass


def ensure_cli(prog: str, doc: str, kind: str, known: Sequence[str], ensure: Callable[..., Path], log: Log,
               argv: list[str] | None = None) -> int:
    """`python -m PROG [--force] [NAME...]`: build or reuse each named binary (all when none is
    named) and print `NAME: PATH` for each; 1 when any build failed (the others still run)."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"{kind}s to build (default: {', '.join(known)})")
    parser.add_argument("--force", action="store_true", help="rebuild even if the stamp matches")
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in known]
    if unknown:
        parser.error(f"unknown {kind} {', '.join(unknown)} (known: {', '.join(known)})")
    failed = 0
    for name in args.names or known:
        try:
            path = ensure(name, force=args.force)
        except BuildError as exc:
            log(f"building {name} failed:\n{exc}")
            failed += 1
            continue
        print(f"{name}: {path}", flush=True)
    return 1 if failed else 0


def ensure_built(force: bool = False, log: Log = _log) -> Path:
    """Build the binaries unless the stamp says they match the pins; returns e2e/.bin."""
    if not force and is_current():
        return BIN_DIR
    if shutil.which("go") is None:
        raise BuildError("`go` is not on PATH; the e2e harness builds Kubernetes from its Go modules")
    started = time.monotonic()
    log(
        f"building kubernetes {pinned_version('k8s.io/kubernetes')}, "
        f"etcd {pinned_version('go.etcd.io/etcd/server/v3')} with {go_version()} (first build takes minutes)"
    )
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="bin-", dir=BUILD_DIR))
    try:
        # etcd's package path ends in /v3, which `go build -o DIR` would name "v3".
        log("go build etcd")
        go_build([BINARIES["etcd"]], staging / "etcd", GO_DIR, _ldflags(), log)
        kube = [name for name in BINARIES if name != "etcd"]
        log(f"go build {' '.join(kube)}")
        go_build([BINARIES[name] for name in kube], staging, GO_DIR, _ldflags(), log)
        BIN_DIR.mkdir(parents=True, exist_ok=True)
        for name in BINARIES:
            os.replace(staging / name, BIN_DIR / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _copy_keda_crds(log)
    STAMP.write_text(json.dumps(wanted_stamp(), indent=2) + "\n")
    log(f"built in {time.monotonic() - started:.0f}s -> {BIN_DIR}")
    return BIN_DIR


def main(argv: list[str] | None = None) -> int:
    return build_cli(
        argv, "python -m e2e.build", __doc__.splitlines()[0], BIN_DIR, STAMP, is_current, ensure_built, _log
    )


if __name__ == "__main__":
    sys.exit(main())
