"""What the gateway needs to know about one model (`RoutedModel`), made from a Model manifest and
its ready endpoints; plain data, shared by every feeder, the federation and `wakegate up`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

from wakegate.control.backends import BACKENDS
from wakegate.control.schema import DEFAULT_PROFILE, Model, Routing, Strategy


@dataclass(frozen=True)
class RoutedAdapter:
    """A LoRAAdapter of a routed model: its names and what the engine is told; plain data."""

    name: str
    names: tuple[str, ...]
    served_name: str
    #: The adapter's id in a llama.cpp server's `--lora` list; -1: the engine takes `served_name` as `model`.
    lora_id: int = -1
    scale: float = 1.0
    #: Loaded at run time: the endpoints ("ip:port") that hold it, loads failed so far, the last reason.
    endpoints: tuple[str, ...] = ()
    failed_loads: int = 0
    last_failure: str = ""


@dataclass(frozen=True)
class UpstreamTls:
    """How Envoy speaks TLS to one endpoint (a federation member gateway): files on this machine
    it reads, and the name its certificate must carry. Never the material itself."""

    #: The endpoints' transport socket match (the member's name).
    name: str
    ca_file: str
    #: Sent as SNI and checked as a DNS SAN; None: `ip_san` is checked, no SNI.
    server_name: str | None = None
    ip_san: str | None = None
    #: The client certificate and key (mTLS); None: none presented.
    cert_file: str | None = None
    key_file: str | None = None


@dataclass(frozen=True)
class RoutedFlow:
    """A Model's flow control with every threshold resolved (the Model's, else its engine's default)."""

    band: str = "standard"
    max_queue: int = 1000
    queue_timeout_s: float = 30.0
    max_waiting: int = 0
    max_kv_usage: float = 0.0
    max_in_flight: int = 0


#: Saturation thresholds of engines that report their load (waiting requests, KV-cache usage):
#: llama.cpp defers a request only when every slot is busy, so one deferred request is saturation.
_ENGINE_WAITING = {"llamacpp": 1}


DEFAULT_MAX_WAITING = 5


DEFAULT_MAX_KV_USAGE = 0.9


#: Requests in flight per replica that saturate an engine that reports no load (Ollama's default
#: parallelism).
DEFAULT_MAX_IN_FLIGHT = 4


def routed_flow(model: Model) -> RoutedFlow | None:
    """The model's flow control, None when it is off; thresholds the Model leaves out are its engine's."""
    flow = model.spec.flowControl
    if not flow.enabled:
        return None
    sat = flow.saturation
    metrics = BACKENDS[model.spec.backend].load_metrics
    waiting = sat.maxWaiting
    kv = sat.maxKvCacheUsage
    in_flight = sat.maxInFlight
    if metrics is None:
        waiting, kv = waiting or 0, kv or 0.0
        if not (waiting or kv or in_flight):
            in_flight = DEFAULT_MAX_IN_FLIGHT
    else:
        waiting = _ENGINE_WAITING.get(model.spec.backend, DEFAULT_MAX_WAITING) if waiting is None else waiting
        kv = (DEFAULT_MAX_KV_USAGE if metrics.kv_usage else 0.0) if kv is None else kv
    return RoutedFlow(
        band=flow.band.value,
        max_queue=flow.maxQueue,
        queue_timeout_s=float(flow.queueTimeout),
        max_waiting=waiting,
        max_kv_usage=kv,
        max_in_flight=in_flight,
    )


@dataclass(frozen=True)
class RoutedModel:
    """What the gateway needs to know about one model; plain data."""

    key: str
    names: tuple[str, ...]
    served_name: str
    lora_adapters: tuple[str, ...] = ()
    adapters: tuple[RoutedAdapter, ...] = ()
    #: The adapters are loaded into running endpoints on demand (each lists its holders), placed so.
    adapters_on_demand: bool = False
    adapter_placement: str = "affinity"
    strategy: str = "default"
    #: scored picking: a named profile, or (scorer, weight) pairs; both empty: `strategy` decides
    profile: str = ""
    weights: tuple[tuple[str, float], ...] = ()
    #: the engines publish KV events on their HTTP port plus this (0: none), replay on plus the second
    kv_events_offset: int = 0
    kv_events_replay_offset: int = 0
    requests_per_second: float = 0.0
    burst: float = 0.0
    cold_mode: str = "hold"
    max_queue: int = 100
    activation_timeout_s: float = 180.0
    #: Ready endpoints as (ip, port).
    endpoints: tuple[tuple[str, int], ...] = ()
    generation: int = 0
    failed_activations: int = 0
    last_failure: str = ""
    #: What kind of failure `last_failure` is ("weights_unavailable"; empty: any other).
    failure_code: str = ""
    admitted: bool = True
    #: (ip, port, requests the engine holds) from the engine's own metrics, where it has them.
    loads: tuple[tuple[str, int, int], ...] = ()
    #: Other ready endpoints named after the pick, for Envoy's retries (`ModelRoute.fallback_endpoints`).
    fallback_endpoints: int = 0
    #: (ip, port, weight): that endpoint's share among endpoints tied on load (`Endpoint.weight`;
    #: the federation's Cluster.spec.weight); none: equal shares.
    endpoint_weights: tuple[tuple[str, int, int], ...] = ()
    #: (ip, port, TLS) for endpoints Envoy reaches over TLS (the federation's https:// members);
    #: the others stay plain.
    endpoint_tls: tuple[tuple[str, int, UpstreamTls], ...] = ()
    #: (ip, port, authorization header) Envoy sets on requests to that endpoint (the federation's
    #: member tokens: EDS metadata read by an upstream filter; never in extproc's ModelRoute).
    endpoint_authorization: tuple[tuple[str, int, str], ...] = ()
    #: The routing path the Model asks for (`routing.path`): "decided" or "native" (where it can).
    path: str = "decided"
    #: A local folder with the model's tokenizer, for precise scoring on engines whose KV events
    #: hash token ids (`ModelRoute.tokenizer`); empty: none.
    tokenizer: str = ""
    #: Flow control (admission while saturated), None when off; it keeps the model decided.
    flow: RoutedFlow | None = None

    @cached_property
    def cluster(self) -> str:
        return cluster_name(self.key)

    @cached_property
    def endpoint_set(self) -> frozenset[tuple[str, int]]:
        """`endpoints` as a set (computed once per model object)."""
        return frozenset(self.endpoints)


def routed_model(
    model: Model,
    endpoints: Iterable[tuple[str, int]],
    *,
    generation: int = 0,
    failed_activations: int = 0,
    last_failure: str = "",
    failure_code: str = "",
    admitted: bool = True,
    loads: Iterable[tuple[str, int, int]] = (),
    adapters: Iterable[RoutedAdapter] | None = None,
    tokenizer: str = "",
) -> RoutedModel:
    """What the gateway needs of a Model manifest plus its current ready endpoints; `adapters`
    (with their holders) means they are loaded on demand."""
    spec = model.spec
    kv = spec.routing.kvEvents
    return RoutedModel(
        key=model.key,
        names=tuple(model.client_names),
        served_name=model.served_name,
        lora_adapters=tuple(spec.loraAdapters),
        adapters=routed_adapters(model) if adapters is None else tuple(adapters),
        adapters_on_demand=adapters is not None,
        adapter_placement=spec.adapters.placement,
        strategy=spec.routing.strategy.value,
        profile=_profile(spec.routing),
        weights=tuple(sorted(spec.routing.weights.scorers().items())) if spec.routing.weights is not None else (),
        kv_events_offset=kv.portOffset if kv is not None else 0,
        kv_events_replay_offset=kv.replayPortOffset if kv is not None else 0,
        requests_per_second=spec.limits.requestsPerSecond,
        burst=spec.limits.burst,
        cold_mode=spec.endpoint.coldMode.value,
        max_queue=spec.endpoint.maxQueue,
        activation_timeout_s=float(spec.scaling.activationTimeout),
        endpoints=tuple(sorted(endpoints)),
        generation=generation,
        failed_activations=failed_activations,
        last_failure=last_failure,
        failure_code=failure_code,
        admitted=admitted,
        loads=tuple(sorted(loads)),
        path=spec.routing.path.value,
        tokenizer=tokenizer,
        flow=routed_flow(model),
    )


def routed_adapters(model: Model) -> tuple[RoutedAdapter, ...]:
    """The model's LoRAAdapters as the gateway routes them; ids follow the manifest's order, which
    is also the order of the `--lora` arguments an engine of `lora_arg` starts with."""
    by_id = bool(BACKENDS[model.spec.backend].lora_arg)
    return tuple(
        RoutedAdapter(
            name=adapter.name,
            names=tuple(adapter.client_names),
            served_name=adapter.served_name,
            lora_id=index if by_id else -1,
            scale=adapter.spec.scale,
        )
        for index, adapter in enumerate(model.adapters)
    )


def _profile(routing: Routing) -> str:
    """The route's profile: the Model's, or the default profile when it names no routing at all."""
    if routing.profile is not None:
        return routing.profile.value
    if routing.weights is None and routing.strategy == Strategy.DEFAULT:
        return DEFAULT_PROFILE.value
    return ""


def cluster_name(model_key: str) -> str:
    return "model." + model_key.replace("/", ".")
