"""Engines wakegate renders but does not run in its own tests: MLC LLM, ComfyUI, diffusers.

- MLC LLM: `mlc_llm serve MODEL --host H --port P` (MODEL: a compiled model folder or a name
  its prebuilt list knows); OpenAI API under /v1; `/v1/models` answers once it serves. The
  project publishes no server image, so a cluster needs an InferenceRuntime of the user's own.
- ComfyUI: started as `python main.py --listen H --port P` from its checkout, so a Model gives the
  command (`spec.command: [python, /path/to/ComfyUI/main.py]`); `/system_stats` answers once it
  serves; its API is its own (workflows), not OpenAI's. No official image.
- diffusers: the library ships no server, only an example; the user brings the command (and, on
  a cluster, the image) of whatever serves the OpenAI images API on `--host`/`--port`.
"""

from __future__ import annotations

from wakegate.control.backends.base import Backend

MLC_LLM = Backend(
    name="mlc-llm",
    description="MLC LLM server (`mlc_llm serve`)",
    program=("mlc_llm", "serve"),
    args=("{model}", "--host", "{host}", "--port", "{port}"),
    default_port=8000,
    health_path="/v1/models",
)

COMFYUI = Backend(
    name="comfyui",
    description="ComfyUI workflow server (spec.command names its main.py)",
    program=(),
    args=("--listen", "{host}", "--port", "{port}"),
    default_port=8188,
    health_path="/system_stats",
    openai_prefix="",
)

DIFFUSERS = Backend(
    name="diffusers",
    description="an OpenAI images API server on diffusers (spec.command names it)",
    program=(),
    args=("--host", "{host}", "--port", "{port}"),
    default_port=8000,
    health_path="/health",
)
