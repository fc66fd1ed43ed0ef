"""Registry of backend plugins: how each engine starts, loads its model, reports load and stops.

A plugin is plain data (base.py); each engine family describes itself in its own module.
`wakegate up` runs plugins as local processes (control/up/engine.py), the operator renders them
into InferenceRuntimes (control/runtimes.py); both append the Model's `spec.args`.
"""

from __future__ import annotations

from wakegate.control.backends.base import (
    Backend,
    BackendError,
    HttpStep,
    Image,
    LoadMetrics,
    LoadSignals,
    fill,
    fill_json,
)
from wakegate.control.backends.llamacpp import LLAMACPP
from wakegate.control.backends.ollama import OLLAMA
from wakegate.control.backends.others import COMFYUI, DIFFUSERS, MLC_LLM
from wakegate.control.backends.vllm import SIM, VLLM, VLLM_OMNI

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendError",
    "HttpStep",
    "Image",
    "LoadMetrics",
    "LoadSignals",
    "fill",
    "fill_json",
]

BACKENDS: dict[str, Backend] = {
    b.name: b for b in (SIM, VLLM, LLAMACPP, OLLAMA, MLC_LLM, DIFFUSERS, COMFYUI, VLLM_OMNI)
}
