"""The simulator's configuration (`SimConfig`): the model it serves and how it behaves."""

from __future__ import annotations

from dataclasses import dataclass, field

from wakegate.control.sim.sleep import SleepConfig
from wakegate.kvevents import KVEventsConfig


@dataclass
class SimConfig:
    model: str
    served_names: list[str]
    #: LoRA adapter name -> its path (``root`` in /v1/models)
    lora_modules: dict[str, str] = field(default_factory=dict)
    startup_seconds: float = 0.0
    ttft_ms: float = 0.0
    tokens_per_second: float = 0.0
    max_concurrency: int = 0
    #: prompt tokens prefilled per second, one prefill at a time; 0 = prefill is free
    prefill_tokens_per_second: float = 0.0
    #: each running request beyond the first slows every decode step by this fraction
    batch_slowdown: float = 0.0
    max_tokens_default: int = 16
    max_model_len: int = 8192
    kv_cache_tokens: int = 32768
    eos_after_tokens: int = 0
    embedding_dim: int = 16
    api_key: str | None = None
    never_ready: bool = False
    #: log each /v1 request's arrival (``sim timing request t=<epoch seconds>``; benchmarks)
    log_requests: bool = False
    #: vLLM's ``--kv-events-config``: publish the prefix cache's block events over ZMQ
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    #: vLLM's ``--enable-lora``: adapters loaded at run time (``/v1/load_lora_adapter``)
    enable_lora: bool = False
    #: vLLM's ``--max-loras``: adapters held at once; the sim refuses a load past it
    max_loras: int = 1
    #: milliseconds one adapter load takes
    lora_load_ms: float = 0.0
    #: vLLM's sleep mode and what it costs (control/sim/sleep.py)
    sleep: SleepConfig = field(default_factory=SleepConfig)

    @property
    def primary(self) -> str:
        return self.served_names[0]
