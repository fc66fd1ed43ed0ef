"""Build the project's container image with a real container runtime (podman), from the Dockerfile.

    python -m e2e.image                      # build (or reuse) it; prints `IMAGE: <ref>`
    python -m e2e.image --push 127.0.0.1:5000   # and push it (plain HTTP) to that registry

The public base (`python:3.11-slim`) cannot be pulled here, so the image is built on a base this
module makes: Debian bookworm's minbase with python3 and venv, by mmdebstrap, imported with
`podman import`. The Debian packages this needs (podman, buildah, mmdebstrap, ...) are installed
with apt when missing.

Everything is cached by its inputs' digest: the base by the mmdebstrap command line, the image by
the base, the Dockerfile and every file it copies. An image whose tag (the digest) is already in
podman's store is reused (~1 s). Progress is logged while the base or the image builds.

Rootful podman runs with a containers.conf of the harness's own (CONTAINERS_CONF, nothing under
/etc changes): runc and the cgroupfs manager (this machine has hybrid cgroup v1, which crun
refuses), and default ulimits the host allows.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from e2e.build import BuildError
from e2e.engines import _cache_dir, _run

ROOT = Path(__file__).resolve().parent.parent
WORK = Path(__file__).resolve().parent / ".build" / "image"

#: Debian packages: the container tools the image needs, and what the real node adds (e2e/node.py)
APT_PACKAGES = ("podman", "buildah", "skopeo", "mmdebstrap", "runc")
NODE_APT_PACKAGES = ("containerd", "containernetworking-plugins", "iptables")
#: a command each package provides, to tell whether it is installed
APT_COMMANDS = {"podman": "podman", "buildah": "buildah", "skopeo": "skopeo", "mmdebstrap": "mmdebstrap",
                "runc": "runc", "containerd": "containerd",
                "containernetworking-plugins": "/usr/lib/cni/bridge", "iptables": "iptables"}

SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
#: what the Dockerfile copies, with itself: the image's inputs
IMAGE_INPUTS = ("Dockerfile", "pyproject.toml", "README.md", "control", "extproc", "proto", "envoy")
REPOSITORY = "localhost/wakegate/wakegate"
ENVOY_REPOSITORY = "localhost/wakegate/envoy"
SIM_REPOSITORY = "localhost/wakegate/sim"
BASE_REPOSITORY = "localhost/wakegate/base"
#: bump when the way the image is built changes (build flags), to force a rebuild
RECIPE = "1"

CONTAINERS_CONF = """\
[containers]
# The host's own limits: podman's defaults (nofile 1048576) exceed what this machine allows.
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""


def _log(msg: str) -> None:
    print(f"[e2e.image] {msg}", file=sys.stderr, flush=True)


def _as_root(cmd: Sequence[str]) -> list[str]:
    return list(cmd) if os.geteuid() == 0 else ["sudo", *cmd]


def install_packages(packages: Iterable[str] = APT_PACKAGES) -> None:
    """apt-get install the packages whose command is missing (Debian's, ~40 s for all)."""
    missing = [p for p in packages if not _provided(APT_COMMANDS.get(p, p))]
    if not missing:
        return
    _log(f"installing Debian packages: {' '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = _as_root(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing])
    if subprocess.run(install, env=env, stdout=subprocess.DEVNULL).returncode != 0:
        subprocess.run(_as_root(["apt-get", "update", "-q"]), env=env, check=True, stdout=subprocess.DEVNULL)
        subprocess.run(install, env=env, check=True, stdout=subprocess.DEVNULL)


def _provided(command: str) -> bool:
    return Path(command).exists() if command.startswith("/") else shutil.which(command) is not None


def podman_env() -> dict[str, str]:
    """The environment podman runs in: the harness's containers.conf."""
    WORK.mkdir(parents=True, exist_ok=True)
    conf = WORK / "containers.conf"
    if not conf.exists() or conf.read_text() != CONTAINERS_CONF:
        conf.write_text(CONTAINERS_CONF)
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def podman(*args: str, check: bool = True, timeout: float | None = 600) -> subprocess.CompletedProcess[str]:
    """`podman ARGS` (as root), output captured; raises BuildError when `check` and it fails."""
    proc = subprocess.run(_as_root(["podman", *args]), capture_output=True, text=True, env=podman_env(),
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise BuildError(f"podman {' '.join(args)} failed (exit {proc.returncode}):\n{proc.stderr}")
    return proc


def _exists(ref: str) -> bool:
    return podman("image", "exists", ref, check=False).returncode == 0


def _digest(parts: Iterable[bytes]) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()


def _mmdebstrap_cmd(out: Path) -> list[str]:
    return ["mmdebstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", SUITE, str(out)]


def base_ref() -> str:
    key = _digest([" ".join(_mmdebstrap_cmd(Path("rootfs.tar"))).encode()])[:16]
    return f"{BASE_REPOSITORY}:{key}"


def ensure_base() -> str:
    """The Debian base image (python3, venv, CA certificates), made by mmdebstrap once (~2 min)."""
    ref = base_ref()
    if _exists(ref):
        return ref
    tar = _cache_dir().parent / "images" / f"base-{ref.rsplit(':', 1)[1]}.tar"
    if not tar.exists():
        tar.parent.mkdir(parents=True, exist_ok=True)
        tmp = tar.with_suffix(".tmp.tar")
        _log(f"mmdebstrap {SUITE} minbase with {', '.join(BASE_PACKAGES)} (about 2 minutes)")
        _run(_as_root(_mmdebstrap_cmd(tmp)), WORK, "mmdebstrap", _log, progress=_mmdebstrap_progress)
        tmp.replace(tar)
    _log(f"podman import {tar.name} -> {ref}")
    podman("import", "--change", "CMD [\"/bin/bash\"]", str(tar), ref)
    return ref


_MMDEBSTRAP_STEPS = ("setup", "update", "download", "extract", "install", "customize", "cleanup", "output")


def _mmdebstrap_progress(line: str) -> tuple[int, int] | None:
    """mmdebstrap logs `I: running apt-get update...` etc.; its phase is the progress."""
    for index, step in enumerate(_MMDEBSTRAP_STEPS):
        if line.startswith("I:") and step in line.lower():
            return index + 1, len(_MMDEBSTRAP_STEPS)
    return None


def _input_files() -> list[Path]:
    files: list[Path] = []
    for name in IMAGE_INPUTS:
        path = ROOT / name
        if path.is_file():
            files.append(path)
            continue
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.endswith(".egg-info"))
            files.extend(Path(dirpath) / f for f in sorted(filenames) if not f.endswith(".pyc"))
    return files


def image_key(base: str) -> str:
    """The digest of everything that decides the image: base, recipe, and each input's path and bytes."""
    parts = [base.encode(), RECIPE.encode()]
    for path in _input_files():
        parts.append(str(path.relative_to(ROOT)).encode())
        # A link (proto/wakegate/control -> control) counts as its target, not its content twice.
        parts.append(os.readlink(path).encode() if path.is_symlink() else path.read_bytes())
    return _digest(parts)[:16]


@dataclass(frozen=True)
class Built:
    #: the component image (`wakegate <subcommand>`), in podman's store
    image: str
    #: the same image with Envoy as its entrypoint (the gateway pod's envoy container)
    envoy: str
    #: the same image with `wakegate sim` as its entrypoint (Models of backend `sim`)
    sim: str
    base: str


def _build_progress(line: str) -> tuple[int, int] | None:
    match = re.match(r"\[\d+/\d+\] STEP (\d+)/(\d+)", line) or re.match(r"STEP (\d+)/(\d+)", line)
    return (int(match.group(1)), int(match.group(2))) if match else None


def ensure_image(base: str | None = None, force: bool = False) -> Built:
    """Build the image from the Dockerfile unless its inputs' digest is already a tag in the store."""
    install_packages()
    base = base or ensure_base()
    key = image_key(base)
    built = Built(f"{REPOSITORY}:{key}", f"{ENVOY_REPOSITORY}:{key}", f"{SIM_REPOSITORY}:{key}", base)
    if not force and all(_exists(ref) for ref in (built.image, built.envoy, built.sim)):
        _log(f"up to date: {built.image}")
        return built
    started = time.monotonic()
    ca = Path(os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt")
    # The host's network for RUN steps: podman's bridge would add NAT chains to this machine's
    # iptables, which other test runs share.
    common = ["podman", "build", "--network=host", "--build-arg", f"BASE={base}", "--pull=never", "--layers",
              "--file", str(ROOT / "Dockerfile")]
    if ca.is_file():
        # pip in the build trusts what this machine trusts (a package proxy's CA).
        common += ["--volume", f"{ca}:/run/wakegate-ca.pem:ro", "--build-arg", "PIP_CERT=/run/wakegate-ca.pem"]
    _log(f"podman build {built.image} on {base}")
    env = podman_env()
    # --force rebuilds every layer once; the other targets then share this build's layers.
    fresh = ["--no-cache"] if force else []
    _run(_as_root([*common, *fresh, "--tag", built.image, str(ROOT)]), ROOT, "podman build", _log, env=env,
         progress=_build_progress)
    for target, ref in (("envoy", built.envoy), ("sim", built.sim)):
        _run(_as_root([*common, "--target", target, "--tag", ref, str(ROOT)]), ROOT,
             f"podman build ({target} target)", _log, env=env, progress=_build_progress)
    _log(f"built in {time.monotonic() - started:.0f}s: {built.image} ({size_mb(built.image):.0f} MB)")
    return built


LLAMA_REPOSITORY = "localhost/wakegate/llama.cpp"
LLAMA_DOCKERFILE = """\
ARG BASE
FROM ${BASE}
COPY llama-server /app/llama-server
USER 10001
ENTRYPOINT ["/app/llama-server"]
"""


def ensure_llama_image(base: str | None = None) -> str:
    """An image like llama.cpp's `:server` (entrypoint /app/llama-server) with the CPU llama-server
    e2e/engines.py builds, on the same Debian base (its libstdc++ is there); cached by digest."""
    from e2e import engines

    base = base or ensure_base()
    server = engines.ensure("llama-server")
    key = _digest([base.encode(), LLAMA_DOCKERFILE.encode(), server.read_bytes()])[:16]
    ref = f"{LLAMA_REPOSITORY}:{key}"
    if _exists(ref):
        return ref
    WORK.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=WORK) as tmp:
        shutil.copy2(server, Path(tmp) / "llama-server")
        (Path(tmp) / "Dockerfile").write_text(LLAMA_DOCKERFILE)
        _log(f"podman build {ref} (llama-server on {base})")
        podman("build", "--network=host", "--pull=never", "--build-arg", f"BASE={base}", "--tag", ref, tmp)
    return ref


def size_mb(ref: str) -> float:
    return int(podman("image", "inspect", "--format", "{{.Size}}", ref).stdout.strip()) / 1e6


def push(ref: str, registry: str, repository: str, tag: str | None = None) -> str:
    """Push `ref` to the plain-HTTP registry HOST:PORT as REPOSITORY:TAG (TAG: `ref`'s unless
    given); returns the pushed reference."""
    target = f"{registry}/{repository}:{tag or ref.rsplit(':', 1)[1]}"
    # zstd: gzip spends most of a push compressing the ~400 MB of layers (containerd reads both).
    podman("push", "--tls-verify=false", "--compression-format=zstd", ref, f"docker://{target}")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.image", description=__doc__.splitlines()[0])
    parser.add_argument("--push", metavar="HOST:PORT", help="push the images to this plain-HTTP registry")
    parser.add_argument("--force", action="store_true", help="rebuild even if the store has the digest's tag")
    args = parser.parse_args(argv)
    try:
        built = ensure_image(force=args.force)
        image, envoy = built.image, built.envoy
        if args.push:
            image = push(built.image, args.push, "wakegate/wakegate")
            envoy = push(built.envoy, args.push, "wakegate/envoy")
            push(built.sim, args.push, "wakegate/sim")
    except (BuildError, subprocess.CalledProcessError) as exc:
        _log(f"failed: {exc}")
        return 1
    print(f"IMAGE: {image}", flush=True)
    print(f"ENVOY_IMAGE: {envoy}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
