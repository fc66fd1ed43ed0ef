"""The extproc process's one metrics registry and the series it exports."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "wakegate_gateway_requests",
            "Requests decided by the gateway, by model, status (`routed` or the status it answered) and error reason.",
            ["model", "code", "reason"],
            registry=r,
        )
        self.in_flight = Gauge(
            "wakegate_gateway_in_flight",
            "Requests routed to a backend and not yet finished.",
            ["model"],
            registry=r,
        )
        self.pick_seconds = Histogram(
            "wakegate_gateway_pick_seconds",
            "Time extproc spends deciding a request (headers and body phases), seconds.",
            buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
            registry=r,
        )
        self.queue_depth = Gauge(
            "wakegate_gateway_queue_depth",
            "Cold requests held for a model on this gateway.",
            ["model"],
            registry=r,
        )
        self.cold_start = Histogram(
            "wakegate_gateway_cold_start_seconds",
            "Cold start as one gateway sees it, from its first cold request (lease start), by stage: "
            "activation_signal (demand delivered to the scaler), first_byte (first held request sent on).",
            ["model", "stage"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        self.queue_limit = Gauge(
            "wakegate_gateway_queue_limit",
            "Cold requests a gateway holds per model at most (maxQueue).",
            ["model"],
            registry=r,
        )
        self.adapter_requests = Counter(
            "wakegate_gateway_adapter_requests",
            "Requests for a LoRA adapter loaded on demand, by outcome: direct (an endpoint held it) or "
            "waited (held for its load, or for its base to wake).",
            ["model", "outcome"],
            registry=r,
        )
        self.flow_queued = Gauge(
            "wakegate_gateway_flow_queued",
            "Requests flow control holds while their model is saturated or starting, by model, tenant and band.",
            ["model", "tenant", "band"],
            registry=r,
        )
        self.flow_wait = Histogram(
            "wakegate_gateway_flow_wait_seconds",
            "Time a request held by flow control waited before it was dispatched, by model and band.",
            ["model", "band"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
            registry=r,
        )
        self.flow_dispatched = Counter(
            "wakegate_gateway_flow_dispatched",
            "Requests flow control held and then dispatched, by model, tenant and band.",
            ["model", "tenant", "band"],
            registry=r,
        )
        self.flow_shed = Counter(
            "wakegate_gateway_flow_shed",
            "Requests flow control refused, by model, tenant, band and reason (over_share, shed, "
            "model_saturated, queue_timeout, token_budget).",
            ["model", "tenant", "band", "reason"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            "wakegate_gateway_tenant_tokens",
            "Tokens (prompt + completion, from the engines' usage) counted against tenants with a budget.",
            ["tenant"],
            registry=r,
        )
        self.routes = Gauge("wakegate_gateway_models", "Models known to this gateway.", registry=r)
        self.route_updates = Counter(
            "wakegate_gateway_route_updates", "Route table updates received from the feeder.", registry=r
        )

    def watch_h2(self, refused: Tally[str]) -> None:
        """Export the HTTP/2 server's refusals (it counts them itself, without prometheus)."""
        self.registry.register(_H2Refusals(refused))


class _H2Refusals(Collector):
    def __init__(self, refused: Tally[str]) -> None:
        self._refused = refused

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "wakegate_gateway_h2_refused",
            "What extproc's HTTP/2 server refused, by limit: connections (connection_limit), streams "
            "(stream_limit, draining) and connections it ended (ping, settings, rst_stream, window_update, "
            "priority, empty_frames, rapid_reset, hpack, header_block, preface_timeout, idle_timeout, "
            "protocol_error).",
            labels=["reason"],
        )
        for reason, count in sorted(self._refused.items()):
            family.add_metric([reason], count)
        yield family
