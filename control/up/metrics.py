"""The `wakegate up` process's one metrics registry: cold starts, swaps, replicas, activation failures,
weights pulled."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from wakegate.control.admin import COLD_START_BUCKETS
from wakegate.control.savings.metrics import wake_histogram


@dataclass
class UpMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.cold_start = Histogram(
            "wakegate_cold_start_seconds",
            "Cold start of a model from zero replicas, by stage: weights (activation signal to the "
            "weights on disk: pulled, checked, staged; models with a source), process_start (activation signal to "
            "spawn), health_pass (spawn to health passing), model_loaded (spawn to the model loaded), "
            "total (activation signal to ready: routed), first_byte (routed to the first byte of the "
            "engine's first answer, a one-token request sent beside the first held requests).",
            ["model", "stage"],
            buckets=COLD_START_BUCKETS,
            registry=r,
        )
        self.wake_seconds = wake_histogram(r)
        self.first_requests = Counter(
            "wakegate_first_requests",
            "Demand onsets (the first request after a time without any) by whether they found the model warm.",
            ["model", "found"],
            registry=r,
        )
        self.predictive_wakes = Counter(
            "wakegate_predictive_wakes",
            "Predictive wakes by outcome: hit (demand found the model warm), late (demand came while it was "
            "still waking), miss (none came).",
            ["model", "outcome"],
            registry=r,
        )
        self.predictive_seconds = Counter(
            "wakegate_predictive_accelerator_seconds",
            "Accelerator-seconds predictive wakes kept models warm before demand came (hit) or in vain "
            "(miss: wasted).",
            ["model", "outcome"],
            registry=r,
        )
        self.cold_starts = Counter("wakegate_cold_starts", "Scale-from-zero activations.", ["model"], registry=r)
        self.activation_failures = Counter(
            "wakegate_activation_failures",
            "Activations given up: every start attempt failed within activationTimeout.",
            ["model"],
            registry=r,
        )
        self.start_attempt_failures = Counter(
            "wakegate_start_attempt_failures",
            "Start attempts that failed (weights unavailable, exited or never loaded), each retried with "
            "backoff while its activation has time.",
            ["model"],
            registry=r,
        )
        self.weights_pulled_bytes = Counter(
            "wakegate_weights_pulled_bytes", "Bytes of weights pulled into the cache (oci://, hf://).", ["model"],
            registry=r,
        )
        self.weights_pull_seconds = Histogram(
            "wakegate_weights_pull_seconds",
            "Duration of each pull of weights into the cache, from its first byte to the entry ready.",
            ["model"],
            buckets=COLD_START_BUCKETS,
            registry=r,
        )
        self.weights_corrupt = Counter(
            "wakegate_weights_corrupt",
            "Cached entries found corrupt before an engine start (removed and fetched again).",
            ["model"],
            registry=r,
        )
        self.adapter_loads = Counter(
            "wakegate_adapter_loads", "LoRA adapters loaded into a running replica on demand.", ["model", "adapter"],
            registry=r,
        )
        self.adapter_unloads = Counter(
            "wakegate_adapter_unloads",
            "LoRA adapters unloaded from a replica: evicted (least recently used, to make room) or idle.",
            ["model", "adapter", "reason"],
            registry=r,
        )
        self.adapter_load_failures = Counter(
            "wakegate_adapter_load_failures",
            "LoRA adapter loads that failed (weights unavailable, or the engine refused).",
            ["model", "adapter"],
            registry=r,
        )
        self.adapter_load_seconds = Histogram(
            "wakegate_adapter_load_seconds",
            "Duration of each on-demand LoRA adapter load: the engine's call, once its weights are in the cache.",
            ["model"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
            registry=r,
        )
        self.swaps = Counter("wakegate_gpu_swaps", "GPU-group hand-overs between models.", ["group"], registry=r)
        self.replicas = Gauge("wakegate_model_replicas", "Backend replicas (any state).", ["model"], registry=r)
        self.ready = Gauge("wakegate_model_ready_replicas", "Backend replicas passing health.", ["model"], registry=r)
        self.queued = Gauge("wakegate_model_queued", "Cold requests held, summed over gateways.", ["model"], registry=r)
        self.in_flight = Gauge(
            "wakegate_model_in_flight", "Requests in flight, summed over gateways.", ["model"], registry=r
        )
        self.leases = Gauge(
            "wakegate_model_activation_leases", "Live activation leases over gateways.", ["model"], registry=r
        )
