"""Registry of backend plugins: how to start a model server and how to know it is ready.

A plugin is plain data. `wakegate up` turns it into a local process, the
operator into an InferenceRuntime; both append the Model's `spec.args`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Backend:
    name: str
    #: Command before the per-model arguments; `{host}`, `{port}`, `{model}` and
    #: `{served_name}` are substituted.
    command: tuple[str, ...]
    default_port: int
    health_path: str
    gpu_vendors: tuple[str, ...]
    #: Container image the Kubernetes runtime uses for this backend.
    image: str
    #: GPU architectures the backend supports; empty = any the vendor ships.
    gpu_arch: tuple[str, ...] = ()
    #: Prometheus metric prefix the backend exposes (for dashboards and the scheduler).
    metrics_prefix: str = ""
    description: str = ""
    env: dict[str, str] = field(default_factory=dict)

    def render_command(self, *, host: str, port: int, model: str, served_name: str) -> list[str]:
        values = {"host": host, "port": str(port), "model": model, "served_name": served_name}
        return [part.format(**values) for part in self.command]


#: `--host {host} --port {port}`, as most OpenAI-compatible servers take their address.
_LISTEN = ("--host", "{host}", "--port", "{port}")
#: vLLM's address and the name it serves (the sim takes the same flags).
_VLLM_FLAGS = (*_LISTEN, "--served-model-name", "{served_name}")

_NVIDIA_ARCH = ("sm70", "sm75", "sm80", "sm86", "sm89", "sm90", "sm100", "sm120")
_AMD_ARCH = ("gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1101", "gfx1200", "gfx1201")

BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend(
            name="sim",
            command=(sys.executable, "-m", "wakegate", "sim", *_VLLM_FLAGS),
            default_port=8000,
            health_path="/health",
            gpu_vendors=(),
            image="ghcr.io/wakegate/sim:latest",
            metrics_prefix="vllm:",
            description="wakegate's vLLM-like simulator (no GPU)",
        ),
        Backend(
            name="vllm",
            command=("vllm", "serve", "{model}", *_VLLM_FLAGS),
            default_port=8000,
            health_path="/health",
            gpu_vendors=("nvidia", "amd"),
            image="vllm/vllm-openai:latest",
            gpu_arch=_NVIDIA_ARCH[1:] + _AMD_ARCH,
            metrics_prefix="vllm:",
            description="vLLM OpenAI-compatible server",
        ),
        Backend(
            name="llamacpp",
            command=("llama-server", "--model", "{model}", *_LISTEN, "--alias", "{served_name}", "--metrics"),
            default_port=8080,
            health_path="/health",
            gpu_vendors=("nvidia", "amd"),
            image="ghcr.io/ggml-org/llama.cpp:server",
            metrics_prefix="llamacpp:",
            description="llama.cpp llama-server",
        ),
        Backend(
            name="ollama",
            command=("ollama", "serve"),
            default_port=11434,
            health_path="/api/version",
            gpu_vendors=("nvidia", "amd"),
            image="ollama/ollama:latest",
            env={"OLLAMA_HOST": "{host}:{port}"},
            description="Ollama (OpenAI-compatible API under /v1)",
        ),
        Backend(
            name="mlc-llm",
            command=("mlc_llm", "serve", "{model}", *_LISTEN),
            default_port=8000,
            health_path="/v1/models",
            gpu_vendors=("nvidia", "amd"),
            image="ghcr.io/mlc-ai/mlc-llm:latest",
            description="MLC LLM server",
        ),
        Backend(
            name="diffusers",
            command=(sys.executable, "-m", "diffusers_server", "--model", "{model}", *_LISTEN),
            default_port=8000,
            health_path="/health",
            gpu_vendors=("nvidia", "amd"),
            image="ghcr.io/wakegate/diffusers:latest",
            description="Hugging Face diffusers image generation server (OpenAI images API)",
        ),
        Backend(
            name="comfyui",
            command=("comfyui", "--listen", "{host}", "--port", "{port}"),
            default_port=8188,
            health_path="/system_stats",
            gpu_vendors=("nvidia", "amd"),
            image="ghcr.io/wakegate/comfyui:latest",
            description="ComfyUI workflow server",
        ),
        Backend(
            name="vllm-omni",
            command=("vllm", "serve", "{model}", "--omni", *_VLLM_FLAGS),
            default_port=8000,
            health_path="/health",
            gpu_vendors=("nvidia", "amd"),
            image="vllm/vllm-omni:latest",
            gpu_arch=_NVIDIA_ARCH[3:],
            metrics_prefix="vllm:",
            description="vLLM-Omni multimodal server",
        ),
    )
}
