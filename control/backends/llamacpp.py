"""llama.cpp's own server, `llama-server`: one GGUF file, OpenAI API under /v1, Prometheus metrics.

- Start: `llama-server --model FILE --alias NAME --host H --port P --metrics`. The server serves
  one model and answers whatever `model` a request names, so the gateway does the name check.
- Health: `/health` refuses connections until the listener is up, answers 503 while the model
  loads and 200 once it is loaded: 200 already means "loaded". One token through the API makes
  sure it also answers (and warms the first request).
- Load: `llamacpp:requests_processing` (busy slots) and `llamacpp:requests_deferred` (requests
  waiting for a slot) are the running/waiting pair vLLM reports; this version has no KV-cache
  usage series.
- LoRA: every LoRAAdapter of the base is given at start (`--lora-init-without-apply --lora FILE`
  each, so none applies by default); a request for one gets `lora: [{id, scale}]` in its body.
  This server cannot load an adapter into a running process, so adding one restarts the base.
- Stop: SIGTERM cuts streams in flight, so wakegate drains first (the load reaching zero).
"""

from __future__ import annotations

from wakegate import contract
from wakegate.control.backends.base import Backend, Image, LoadMetrics

LLAMACPP = Backend(
    name="llamacpp",
    description="llama.cpp llama-server (one GGUF file)",
    program=("llama-server",),
    args=("--model", "{model}", "--alias", "{served_name}", "--host", "{host}", "--port", "{port}", "--metrics"),
    default_port=8080,
    health_path="/health",
    images=(
        Image("cpu", "ghcr.io/ggml-org/llama.cpp:server", program=("/app/llama-server",)),
        Image("nvidia", "ghcr.io/ggml-org/llama.cpp:server-cuda", program=("/app/llama-server",), suffix="cuda"),
        Image("amd", "ghcr.io/ggml-org/llama.cpp:server-rocm", program=("/app/llama-server",), suffix="rocm"),
    ),
    metrics_path="/metrics",
    metrics_prefix="llamacpp:",
    load_metrics=LoadMetrics(
        running=(contract.LLAMACPP_RUNNING,),
        waiting=(contract.LLAMACPP_WAITING,),
        kv_usage=(contract.LLAMACPP_KV_USAGE,),
    ),
    answer_probe=True,
    needs_file=True,
    term_grace=5.0,
    # This server loads adapters only at start (POST /lora-adapters sets scales of loaded ones):
    # every LoRAAdapter of the base is loaded at scale 0 and applied per request by id.
    lora_arg="--lora",
    lora_start_args=("--lora-init-without-apply",),
)
