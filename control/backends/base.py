"""What a backend plugin is: plain data describing how an engine starts, loads, reports load and stops.

Pure: no process, socket or file is touched here. `wakegate up` (control/up/engine.py) and the
operator (control/operator/render.py) read these descriptions; each engine family describes
itself in its own module (llamacpp.py, ollama.py, vllm.py, sim.py, others.py).

Templates in commands, environment and HTTP steps take `{host}`, `{port}`, `{model}` (the
weights the engine loads: a file, a directory or a hub name), `{served_name}` and `{state}` (a
folder private to one replica).
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from wakegate import promtext

Vendor = Literal["cpu", "nvidia", "amd"]


@dataclass(frozen=True)
class Image:
    """A container image the engine's makers publish, and what it runs on."""

    vendor: Vendor
    reference: str
    #: The image's own path to the engine, when it differs from `Backend.program`.
    program: tuple[str, ...] = ()
    #: Suffix of the InferenceRuntime's name (`llamacpp-cuda`); "" for the backend's plain name.
    suffix: str = ""


@dataclass(frozen=True)
class HttpStep:
    """One HTTP exchange with the engine: a load step, or a check that the model is loaded."""

    method: Literal["GET", "POST"]
    path: str
    #: JSON body (strings templated); ignored when `upload_model` is set.
    body: Mapping[str, Any] | None = None
    #: The body is the model file itself (Ollama's blob upload); `{sha256}` is its digest.
    upload_model: bool = False
    #: The answer must contain this text (templated), e.g. the model's name in a listing.
    contains: str = ""
    #: Seconds the step may take (a model load can be slow).
    timeout: float = 600.0
    what: str = ""


@dataclass(frozen=True)
class LoadSignals:
    """An engine's own view of its load, in the terms least-loaded picking and demand use."""

    #: Requests the engine is decoding now.
    running: int
    #: Requests admitted but waiting for a free slot.
    waiting: int
    #: Share of the KV cache in use, 0..1, where the engine reports one.
    kv_usage: float | None = None

    @property
    def queue(self) -> int:
        """What picking compares: every request the engine holds."""
        return self.running + self.waiting


@dataclass(frozen=True)
class LoadMetrics:
    """Which Prometheus series of the engine's metrics mean what. Sums over labels."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_usage: tuple[str, ...] = ()

    def parse(self, text: str) -> LoadSignals | None:
        """The load in a Prometheus text exposition; None when the running series is missing."""
        values = _samples(text)
        running = _first(values, self.running)
        if running is None:
            return None
        waiting = _first(values, self.waiting) or 0.0
        kv = _first(values, self.kv_usage)
        return LoadSignals(int(running), int(waiting), kv)

    def kv(self, text: str) -> float | None:
        """The KV-cache usage (0..1) in a Prometheus text exposition; None when it has none.

        The fullest of its label sets (vLLM with data parallelism reports one per engine): a
        share does not add up across caches the way request counts do.
        """
        return _first(_samples(text, max), self.kv_usage)


def _samples(text: str, combine: Callable[[float, float], float] = operator.add) -> dict[str, float]:
    """Metric name -> value combined over its label sets (summed); NaN samples are left out."""
    out: dict[str, float] = {}
    for name, _, value in promtext.samples(text):
        if not math.isnan(value):
            out[name] = combine(out[name], value) if name in out else value
    return out


def _first(values: Mapping[str, float], names: tuple[str, ...]) -> float | None:
    for name in names:
        if name in values:
            return values[name]
    return None


class BackendError(ValueError):
    """A Model this backend cannot serve as written (the message says what to change)."""


@dataclass(frozen=True)
class Backend:
    name: str
    description: str
    #: The executable and its fixed leading words (`("vllm", "serve")`); () means the engine has
    #: no standard command and a Model must give `spec.command`.
    program: tuple[str, ...]
    #: Flags after the program; the Model's `spec.args` follow them.
    args: tuple[str, ...]
    default_port: int
    #: Answers 200 once the HTTP server is up (and, for most engines, the model loaded).
    health_path: str
    #: Images the engine's makers publish; one shipped InferenceRuntime per image.
    images: tuple[Image, ...] = ()
    #: GPU architectures the engine supports; empty = any its vendors ship.
    gpu_arch: tuple[str, ...] = ()
    #: Where the OpenAI-compatible API lives ("" for engines without one).
    openai_prefix: str = "/v1"
    env: Mapping[str, str] = field(default_factory=dict)
    #: Prometheus metric prefix (dashboards) and the load series (picking, draining).
    metrics_path: str = ""
    metrics_prefix: str = ""
    load_metrics: LoadMetrics | None = None
    #: Run once per process after health passes: whatever makes the model loaded (Ollama's create).
    prepare: tuple[HttpStep, ...] = ()
    #: Checks that the model is loaded, after `prepare` and again while the replica is ready.
    loaded: tuple[HttpStep, ...] = ()
    #: One token is asked through the OpenAI API: the model answers (and the cold-start timeline
    #: gets its first byte). Asked beside the first requests once the replica is routed, unless
    #: `load_by_answering`.
    answer_probe: bool = False
    #: The token is asked before routing, after `prepare`: the answer is what loads the model
    #: (Ollama loads on the first request; a separate load request would cost a second round).
    load_by_answering: bool = False
    #: The engine loads one weight file (GGUF), so `spec.source` must name one.
    needs_file: bool = False
    #: The engine loads a model folder (config, tokenizer and weights: a Hugging Face layout), so
    #: it is given the source's folder even when that holds a single weight file.
    loads_folder: bool = False
    #: When SIGTERM does not drain in-flight requests, wakegate waits for the load to reach zero first.
    drains_on_sigterm: bool = False
    #: Seconds between SIGTERM and SIGKILL.
    term_grace: float = 10.0
    #: LoRA adapters given at start, one `lora_arg FILE` each after `lora_start_args`, and applied
    #: per request by their index in that list (llama.cpp); empty: the engine loads adapters at run
    #: time and takes the adapter's name as `model` (vLLM).
    lora_arg: str = ""
    lora_start_args: tuple[str, ...] = ()
    #: Engines that load adapters at run time (vLLM's `POST /v1/load_lora_adapter`): appended to
    #: the command of a Model that has LoRAAdapters ({max_adapters} is spec.adapters.maxAdapters),
    #: and the environment that allows it.
    lora_runtime_args: tuple[str, ...] = ()
    lora_runtime_env: tuple[tuple[str, str], ...] = ()
    #: Engines that publish KV events (vLLM's `--kv-events-config JSON`): the flag, and what
    #: turns on the prefix cache whose blocks they report. Given to a Model whose routing names
    #: `kvEvents` and whose args do not set the flag themselves (`kv_events_argv`).
    kv_events_arg: str = ""
    prefix_caching_args: tuple[str, ...] = ()
    #: Its KV events name blocks by vLLM's SHA-256 chain over the prompt's token ids, so the
    #: gateway tokenizes prompts with the model's tokenizer and chat template to match them
    #: (`ModelRoute.tokenizer`); False: by the simulator's words (`wakegate.kvevents`).
    kv_hashes_token_ids: bool = False

    @property
    def serves_adapters(self) -> bool:
        """Whether wakegate can give this engine LoRAAdapters (at start or at run time)."""
        return bool(self.lora_arg or self.lora_runtime_args)
    #: In a container, a command and arguments that replace program + args (for engines whose
    #: `prepare` steps must run inside the pod); empty: program + args.
    container_command: tuple[str, ...] = ()
    container_args: tuple[str, ...] = ()

    @property
    def gpu_vendors(self) -> tuple[str, ...]:
        """Accelerator vendors a published image supports."""
        return tuple(dict.fromkeys(i.vendor for i in self.images if i.vendor != "cpu"))

    @property
    def cpu(self) -> bool:
        """Whether the engine runs without an accelerator (a CPU image, or no image at all)."""
        return not self.images or any(i.vendor == "cpu" for i in self.images)

    @property
    def load_signal(self) -> str:
        """In words, what least-loaded picking and draining read for this engine."""
        m = self.load_metrics
        if m is None:
            return "the gateway's in-flight count (the engine reports no queue)"
        return f"the engine's {m.running[0]} + {m.waiting[0]}, or the gateway's in-flight count if higher"

    def image_for(self, vendor: str | None) -> Image | None:
        """The published image for `vendor` (None: the CPU image, else the first one)."""
        wanted = vendor or "cpu"
        for image in self.images:
            if image.vendor == wanted:
                return image
        return self.images[0] if vendor is None and self.images else None

    def command(self, values: Mapping[str, str], program: tuple[str, ...] | list[str] = ()) -> list[str]:
        """The engine's argv: `program` (a Model's `spec.command`) or the plugin's, then the flags."""
        head = tuple(program) or self.program
        if not head:
            raise BackendError(f"backend {self.name} has no standard command: set spec.command")
        return [*head, *(fill(a, values) for a in self.args)]

    def environment(self, values: Mapping[str, str]) -> dict[str, str]:
        return {key: fill(value, values) for key, value in self.env.items()}


def fill(template: str, values: Mapping[str, str]) -> str:
    """`template` with each `{name}` of `values` replaced (other braces kept, unlike str.format)."""
    out = template
    for key, value in values.items():
        out = out.replace("{" + key + "}", value)
    return out


def fill_json(value: Any, values: Mapping[str, str]) -> Any:
    """A JSON value with every string templated."""
    if isinstance(value, str):
        return fill(value, values)
    if isinstance(value, Mapping):
        return {k: fill_json(v, values) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [fill_json(v, values) for v in value]
    return value


def kv_events_argv(backend: Backend, args: Sequence[str], port: int, offset: int, replay_offset: int = 0) -> list[str]:
    """What `backend` needs to publish KV events on its HTTP `port` + `offset` (and a replay socket
    on `port` + `replay_offset`, 0: none) when a Model's routing asks for them: vLLM binds a
    `tcp://*:PORT` endpoint (a concrete address would make it connect instead), so gateways
    connect. Nothing for engines without KV events, or when `args` already configure them."""
    if not backend.kv_events_arg or not offset or backend.kv_events_arg in args:
        return []
    config: dict[str, Any] = {"enable_kv_cache_events": True, "publisher": "zmq"}
    config["endpoint"] = f"tcp://*:{port + offset}"
    if replay_offset:
        config["replay_endpoint"] = f"tcp://*:{port + replay_offset}"
    config["topic"] = "kv-events"
    caching = [a for a in backend.prefix_caching_args if a not in args]
    return [*caching, backend.kv_events_arg, json.dumps(config, separators=(",", ":"))]
