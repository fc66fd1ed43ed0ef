"""Pure snapshot builder: routable models in, Envoy and extproc xDS resources out.

No I/O. The same builder serves the local runtime (`wakegate up`) and the
Kubernetes watch (`wakegate xds`): both describe what is routable as
`RoutedModel` values and get back typed resources keyed by type URL and name.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, TypeVar

# Importing the generated modules registers their types in the default pool, which
# json_format needs to resolve "@type" inside Any fields.
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.access_loggers.filters.cel.v3 import cel_pb2  # noqa: F401
from envoy.extensions.access_loggers.grpc.v3 import als_pb2  # noqa: F401
from envoy.extensions.filters.http.api_key_auth.v3 import api_key_auth_pb2  # noqa: F401
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2  # noqa: F401
from envoy.extensions.filters.http.header_mutation.v3 import header_mutation_pb2 as upstream_header_mutation_pb2  # noqa: F401
from envoy.extensions.filters.http.json_to_metadata.v3 import json_to_metadata_pb2  # noqa: F401
from envoy.extensions.filters.http.local_ratelimit.v3 import local_rate_limit_pb2  # noqa: F401
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401
from envoy.extensions.filters.http.upstream_codec.v3 import upstream_codec_pb2  # noqa: F401
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2  # noqa: F401
from envoy.extensions.http.early_header_mutation.header_mutation.v3 import header_mutation_pb2  # noqa: F401
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2  # noqa: F401
from envoy.extensions.load_balancing_policies.override_host.v3 import override_host_pb2  # noqa: F401
from envoy.extensions.load_balancing_policies.round_robin.v3 import round_robin_pb2  # noqa: F401
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2  # noqa: F401
from envoy.extensions.retry.priority.previous_priorities.v3 import previous_priorities_config_pb2  # noqa: F401
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2  # noqa: F401
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2  # noqa: F401
from google.protobuf import any_pb2, json_format
from google.protobuf.message import Message

from wakegate import contract
from wakegate.control.backends import BACKENDS
from wakegate.control.schema import DEFAULT_PROFILE, Model, Routing, Strategy
from wakegate.envoycounters import stat_name
from wakegate.keyfile import Scope
from wakegate.v1 import routing_pb2

_M = TypeVar("_M", bound=Message)

LISTENER = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
CLUSTER = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
MODEL_ROUTE = contract.MODEL_ROUTE_TYPE

#: Types a client gets in full on every response (no resource names asked).
WILDCARD_TYPES = frozenset({LISTENER, CLUSTER, MODEL_ROUTE})

LISTENER_NAME = "wakegate_http"
ROUTE_NAME = "wakegate_routes"
UPSTREAM_HEADER = "x-wakegate-upstream"


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


#: Strategies Envoy's own load balancing does as extproc would (docs/decisions.md): round robin
#: exactly; least-loaded by a full scan of this Envoy's active requests per endpoint (what extproc
#: counts, less the engines' readings of other gateways' traffic).
NATIVE_STRATEGIES = frozenset({"round-robin", "least-loaded"})


def native_blocker(model: RoutedModel, settings: GatewaySettings) -> str:
    """Why `model` takes the decided path (extproc) now; empty when Envoy can route it alone.

    Static reasons first (what the spec or the gateway needs of extproc), then the moment's:
    a model with no ready endpoint is cold, and only extproc holds or wakes.
    """
    static = static_native_blocker(model, settings)
    if static:
        return static
    if not model.admitted:
        return "waiting for its GPU group"
    if not model.endpoints:
        return "no ready endpoint"
    return ""


def static_native_blocker(model: RoutedModel, settings: GatewaySettings) -> str:
    """What keeps `model` on the decided path whether it is warm or cold: its manifest or the
    gateway's settings need extproc. Empty: the model is native whenever it is warm."""
    if model.path != "native":
        return "routing.path is decided"
    if not settings.native_allowed:
        return "the gateway's native path is off (API keys or a global rate limit on the cluster)"
    if model.strategy not in NATIVE_STRATEGIES or model.profile or model.weights:
        return "scored or sticky picking (native takes strategy round-robin or least-loaded)"
    if model.adapters or model.lora_adapters:
        return "LoRA adapters"
    if settings.global_rate_limit or settings.global_rps > 0:
        return "a gateway-wide rate limit (--global-rps)"
    if model.flow is not None:
        return "flow control (requests are admitted by extproc)"
    return ""


def routing_path(model: RoutedModel, settings: GatewaySettings) -> dict[str, str]:
    """`routingPath` (native or decided) and, when decided, `routingPathReason` (native_blocker):
    what `wakegate up`'s /status and a Model's status on a cluster say of the model's path now."""
    blocker = native_blocker(model, settings)
    if not blocker:
        return {"routingPath": "native"}
    return {"routingPath": "decided", "routingPathReason": blocker}


def native_keys(
    models: Sequence[RoutedModel],
    settings: GatewaySettings,
    confirmed: Mapping[str, frozenset[tuple[str, int]]] | None = None,
) -> frozenset[str]:
    """Models Envoy routes alone in one gateway's view.

    With `confirmed` (what the gateway's Envoy acknowledged), a model goes native only once its
    Envoy has at least one of its ready endpoints: a native route never points at a cluster
    Envoy has no host in. Clusters missing from `confirmed` are not gated (no Envoy to wait for).
    """
    out = set()
    for m in models:
        if native_blocker(m, settings):
            continue
        if confirmed is not None and m.cluster in confirmed and not set(m.endpoints) & confirmed[m.cluster]:
            continue
        out.add(m.key)
    return frozenset(out)


@dataclass(frozen=True)
class GatewaySettings:
    """Shape of the Envoy listener; the same for every model."""

    listen_host: str = "127.0.0.1"
    listen_port: int = 8080
    #: Largest request body the gateway buffers to read `model`, bytes.
    max_request_bytes: int = 8 * 1024 * 1024
    #: Upper bound extproc may hold a cold request (override_message_timeout).
    max_hold_seconds: int = 3600
    #: Per-exchange timeout for extproc when it does not ask for more. Generous: under a burst of
    #: thousands of new requests extproc may answer late, and late beats a 504.
    extproc_message_timeout_ms: int = 10000
    #: Idle timeout of a stream (0 disables); long generations send tokens often.
    stream_idle_timeout_s: int = 300
    upstream_connect_timeout_ms: int = 2000
    #: Connections Envoy opens to one model's backends at most; more requests queue in Envoy.
    upstream_max_connections: int = 1024
    #: Add `x-wakegate-upstream: ip:port` to responses (debugging; reveals backend addresses).
    upstream_header: bool = False
    extra_listener_filters: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    #: Static clusters of the extproc processes' access-log services (the bootstrap's); every
    #: finished request is logged to each, unbatched: extproc's in-flight counts end there.
    access_log_clusters: tuple[str, ...] = (contract.access_log_cluster(0),)
    #: Other upstreams a request is tried on when one cannot be connected to or resets before the
    #: request was sent (never after: nothing reached the client yet); 0: none. The federation's
    #: global gateway sets it, its upstreams being whole member gateways.
    upstream_retries: int = 0
    #: Envoy's retry_on for those retries; `reset` (before the response began) may repeat a request
    #: an upstream had started on, never one whose answer reached the client.
    upstream_retry_on: str = "connect-failure,refused-stream,reset-before-request"
    #: Models may take the native path (Envoy routes them alone): `wakegate up` always (its feeder
    #: gives the native routes the keys extproc checks); `wakegate xds --native-path`, which the
    #: chart sets only for a gateway with no API keys and no global rate limit.
    native_allowed: bool = False
    #: Requests must carry a key of the gateway's key file: native routes check it with Envoy's
    #: api_key_auth, from the `GatewayKey`s `build` is given (never in these settings, which
    #: travel in a command line).
    key_checks: bool = False
    #: extproc keeps a gateway-wide token bucket (`--global-rps`): every request must meet it, so
    #: no model takes the native path (Envoy's buckets are per model only).
    global_rate_limit: bool = False
    #: The gateway-wide bucket (`--global-rps`, `--global-burst`; 0: none) kept in Envoy's local
    #: rate limit for every request a counted route names the model of (envoy_rate_limited): one
    #: bucket whichever extproc a request reaches. extproc keeps its own for the rest.
    global_rps: float = 0.0
    global_burst: float = 0.0
    #: A request whose ext_proc stream fails before extproc decided it (the extproc holding it
    #: died or stalled) goes through this Envoy again, on the internal listener REPLAY_LISTENER,
    #: where the other (or the restarted) extproc decides it: the request reached no model server
    #: yet, so nothing runs twice (`replay_listener`). Needs the bootstrap's internal listener
    #: extension and REPLAY_CLUSTER: `wakegate up` sets it.
    replay: bool = False


@dataclass(frozen=True)
class GatewayKey:
    """One API key as Envoy's native routes check it; the key itself never in a repr."""

    #: The non-secret id api_key_auth knows the key by (routes allow clients, not keys).
    client: str
    key: str = field(repr=False)
    #: The models it may use, by extproc's own rule (`Scope.allows`).
    scope: Scope


def gateway_keys(entries: Iterable[tuple[str, Scope]]) -> tuple[GatewayKey, ...]:
    """The key file's (key, scope) entries as Envoy's credentials, each named `k<n>` by its place."""
    return tuple(GatewayKey(f"k{n}", key, scope) for n, (key, scope) in enumerate(entries))


@dataclass(frozen=True)
class Resources:
    """One consistent set of resources: type URL -> name -> message."""

    by_type: Mapping[str, Mapping[str, Message]]
    #: Keys of the models Envoy routes alone in this (base) snapshot: `native_keys` without gating.
    native: frozenset[str] = frozenset()

    def select(self, type_url: str, names: Iterable[str]) -> dict[str, Message]:
        available = self.by_type.get(type_url, {})
        wanted = set(names)
        if type_url in WILDCARD_TYPES or not wanted:
            return dict(available)
        return {n: m for n, m in available.items() if n in wanted}


def version_of(resources: Mapping[str, Message]) -> str:
    """Content hash: equal resource sets have equal versions, so nothing is re-sent needlessly.

    Built from each resource's own digest (`resource_digest`), which is computed once per message
    object: a thousand unchanged resources cost a thousand dictionary lookups, not serialisations.
    """
    digest = hashlib.blake2b(digest_size=12)
    for name in sorted(resources):
        digest.update(name.encode())
        digest.update(b"\0")
        digest.update(resource_digest(resources[name]))
    return digest.hexdigest()


#: id(message) -> (message, digest). The message is kept alive by the entry, so its id cannot be
#: taken by another object while the entry stands; resources are never changed once built.
_DIGESTS: dict[int, tuple[Message, bytes]] = {}
#: Entries kept at most; past it the oldest half goes (the live set is a few per model and gateway).
DIGEST_MEMO_LIMIT = 200_000


def resource_digest(message: Message) -> bytes:
    """A digest of one resource's content, memoised per message object (built messages never change)."""
    found = _DIGESTS.get(id(message))
    if found is not None and found[0] is message:
        return found[1]
    value = hashlib.blake2b(message.SerializeToString(deterministic=True), digest_size=12).digest()
    if len(_DIGESTS) >= DIGEST_MEMO_LIMIT:
        for key in list(_DIGESTS)[: DIGEST_MEMO_LIMIT // 2]:
            del _DIGESTS[key]
    _DIGESTS[id(message)] = (message, value)
    return value


def pack(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def _parse(message: _M, data: dict[str, Any]) -> _M:
    json_format.ParseDict(data, message)
    return message


def _error_format(code: str, message: str, error_type: str) -> dict[str, Any]:
    """A local reply body in the gateway's one error shape (the same as extproc/responses.py)."""
    return {
        "json_format": {"error": {"message": message, "type": error_type, "code": code}},
        "content_type": "application/json",
    }


def _status(status: int, op: str = "EQ") -> dict[str, Any]:
    return {"status_code_filter": {"comparison": {"op": op, "value": {"default_value": status, "runtime_key": "_"}}}}


def _flags(*flags: str) -> dict[str, Any]:
    return {"response_flag_filter": {"flags": list(flags)}}


def _mapper(match: dict[str, Any], code: str, message: str, error_type: str) -> dict[str, Any]:
    return {"filter": match, "body_format_override": _error_format(code, message, error_type)}


def _cel(expression: str) -> dict[str, Any]:
    """An access-log filter matching replies for which the CEL `expression` holds."""
    return {
        "extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
                "expression": expression,
            },
        }
    }


def _gateway_unavailable(match: dict[str, Any], *, unserved: bool) -> dict[str, Any]:
    """The 503 + Retry-After for an ext_proc stream that failed; `unserved`: with the mark."""
    headers: list[dict[str, Any]] = [
        {"header": {"key": "retry-after", "value": "1"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
    ]
    if unserved:
        headers.append(
            {"header": {"key": contract.UNSERVED_HEADER, "value": "1"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
        )
    message = "the gateway is starting or restarting a component; retry shortly"
    return {
        **_mapper(match, "gateway_unavailable", message, _SERVER),
        "status_code": 503,
        "headers_to_add": headers,
    }


#: A reply that carries a content type already was written by extproc (its errors are shaped,
#: /metrics is Prometheus text): it passes through unchanged. Envoy's own replies (codec
#: errors, limits, upstream failures, direct responses) have no content type at this point.
_WRITTEN_BY_EXTPROC = _cel("'content-type' in response.headers")

_CLIENT = "invalid_request_error"
_SERVER = "server_error"

#: The listener's local_reply_config: every reply Envoy makes itself becomes the OpenAI error
#: shape. The first mapper that matches wins; the body_format at the end takes the rest.
#: `%RESPONSE_CODE_DETAILS%` is Envoy's fixed token for why it answered (`http1.codec_error`,
#: `path_normalization_failed`, `missing_host_header`, ...): it names the problem without
#: echoing anything from the request.
LOCAL_REPLY_CONFIG: dict[str, Any] = {
    "mappers": [
        {
            "filter": _WRITTEN_BY_EXTPROC,
            "body_format_override": {"text_format_source": {"inline_string": "%LOCAL_REPLY_BODY%"}},
        },
        _mapper(_status(413), "body_too_large", "request body is larger than the gateway accepts", _CLIENT),
        _mapper(_status(431), "headers_too_large", "request headers are larger than the gateway accepts", _CLIENT),
        _mapper(_status(426), "unsupported_http_version", "the gateway accepts HTTP/1.1 and HTTP/2", _CLIENT),
        _mapper(_status(408), "request_timeout", "the request did not arrive in time", _CLIENT),
        _mapper(_status(404), "no_route", "no route for this request", _CLIENT),
        _mapper(
            _status(501),
            "not_implemented",
            "the gateway does not support this request: %RESPONSE_CODE_DETAILS%",
            _CLIENT,
        ),
        _mapper(_flags("UT"), "upstream_timeout", "the model server did not answer in time", _SERVER),
        _mapper(_flags("UH", "UF", "UO", "URX", "UC", "NC"), "upstream_unavailable", "%LOCAL_REPLY_BODY%", _SERVER),
        # extproc itself never answers 500 or 504: these are the gateway failing to
        # reach it (stream reset, message timeout). Upstream failures matched above.
        # No extproc answered (none running yet, or the one holding the request died): a
        # retriable 503 with Retry-After, never a 500 (docs/reliability.md). Marked unserved
        # (contract) where no upstream host was ever chosen for the request: with extproc's
        # default `--release-on access-log` that is every such reply, since its stream ends once
        # the request is routed; with `--release-on stream` the stream can also fail while a
        # model server has the request, and that reply is not marked.
        _gateway_unavailable(_cel("response.code == 500 && !has(upstream.address)"), unserved=True),
        _gateway_unavailable(_status(500), unserved=False),
        _mapper(_status(504), "gateway_timeout", "the gateway did not decide in time", _SERVER),
        _mapper(
            _status(400), "invalid_http_request", "the request is not valid HTTP: %RESPONSE_CODE_DETAILS%", _CLIENT
        ),
        _mapper(_status(500, "GE"), "gateway_error", "the gateway could not answer: %RESPONSE_CODE_DETAILS%", _SERVER),
    ],
    "body_format": _error_format(
        "request_refused", "the gateway refused the request: %RESPONSE_CODE_DETAILS%", _CLIENT
    ),
}


API_KEY_AUTH = "envoy.filters.http.api_key_auth"


def _details(details: str) -> dict[str, Any]:
    """Matches a reply whose response code details (Envoy's fixed token for why) are `details`."""
    return _cel(f"response.code_details == '{details}'")


#: Envoy's api_key_auth answers on native routes, made extproc's (extproc/service.py): an unknown
#: key is its 401; a known key whose scope leaves the model out is the 404 of a model that does
#: not exist, named as asked (each native route is named after the name it matches). That 403 is
#: matched by its details (`client_not_allowed`), not its status: Envoy refuses an upgrade
#: (WebSocket) with a 403 of its own (`upgrade_failed`), which must stay `request_refused`.
_KEY_CHECK_REPLIES = [
    _mapper(_status(401), "invalid_api_key", "missing or invalid API key", "authentication_error"),
    {
        **_mapper(
            _details("client_not_allowed"), "model_not_found", "model '%ROUTE_NAME%' does not exist", "not_found_error"
        ),
        "status_code": 404,
    },
]


#: Checks API keys on the native routes, which switch it on with their own config (the keys go in
#: RDS: a listener update would drain connections at every rotation). After json_to_metadata, so a
#: route chosen by the body's `model` is the one it checks; before ext_proc, which decided
#: routes keep for their own check.
_API_KEY_AUTH_FILTER = {
    "name": API_KEY_AUTH,
    "disabled": True,
    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.api_key_auth.v3.ApiKeyAuth"},
}


def _processing_mode(request_body: str) -> dict[str, str]:
    return {
        "request_header_mode": "SEND",
        "response_header_mode": "SKIP",
        "request_body_mode": request_body,
        "response_body_mode": "NONE",
        "request_trailer_mode": "SKIP",
        "response_trailer_mode": "SKIP",
    }


#: The last HTTP filter of every listener: Envoy's router.
ROUTER_FILTER = {
    "name": "envoy.filters.http.router",
    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
}


def http_listener(name: str, host: str, port: int | str, hcm: dict[str, Any]) -> dict[str, Any]:
    """A listener with one HTTP connection manager (`hcm`: its config without the type)."""
    typed = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
        ".HttpConnectionManager",
        **hcm,
    }
    return {
        "name": name,
        "address": {"socket_address": {"address": host, "port_value": port}},
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": typed}]}
        ],
    }


def _completion_log(cluster: str, native: bool = False) -> dict[str, Any]:
    """Envoy's gRPC access logger to one extproc: every request, sent as it ends. With `native`,
    the natively routed ones are left out (extproc never saw them: their entries would only cost
    it CPU); otherwise unfiltered on purpose: a request extproc counted whose routing mutation
    Envoy refused still ends here."""
    unless_native = {
        "filter": {
            "header_filter": {"header": {"name": contract.NATIVE_HEADER, "present_match": True, "invert_match": True}}
        }
    }
    return {
        "name": "envoy.access_loggers.http_grpc",
        **(unless_native if native else {}),
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {
                "log_name": "wakegate-completions",
                "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": cluster}},
                # Unbatched: a finished request releases its endpoint for least-loaded picking at once.
                "buffer_size_bytes": 0,
                "buffer_flush_interval": "0.05s",
            },
        },
    }


JSON_TO_METADATA = "envoy.filters.http.json_to_metadata"

#: Reads the body's `model` into dynamic metadata for the native routes (route_configuration).
#: In the chain only where some model asks for the native path (`may_go_native`); then every
#: route turns it off but the catch-all, and that one too while no model is native now. (A
#: filter off by default cannot be turned on by a route: Envoy refuses an empty per-route
#: FilterConfig, and this filter takes no per-route config.)
_JSON_TO_METADATA_FILTER = {
    "name": JSON_TO_METADATA,
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.json_to_metadata.v3.JsonToMetadata",
        "request_rules": {
            # Any JSON media type, parameters too (`application/json; charset=utf-8`, as many
            # clients send it): the filter's default takes only the bare `application/json`,
            # which left such requests decided (and counted by extproc's bucket, not Envoy's).
            "allow_content_types_regex": {"regex": r"(?i)application/json\s*(;.*)?"},
            "rules": [
                {
                    "selectors": [{"key": "model"}],
                    "on_present": {
                        "metadata_namespace": contract.NATIVE_METADATA_NAMESPACE,
                        "key": "model",
                        "type": "STRING",
                    },
                }
            ],
        },
    },
}


def may_go_native(models: Iterable[RoutedModel], settings: GatewaySettings) -> bool:
    """Whether any model asks for the native path where the gateway allows it: the listener then
    has what native routes need. It follows the manifests only, not warm and cold, so the
    listener (whose updates drain connections) does not change when a model wakes or sleeps, and
    a gateway whose models are all decided has exactly the listener it had before."""
    return settings.native_allowed and any(m.path == "native" for m in models)


#: Route metadata namespace: the model whose bucket in Envoy's local rate limit a route draws from
#: (`model`, its key) and the Retry-After of a refusal there (`retry_after`).
RATE_LIMIT_METADATA = "wakegate.ratelimit"
LOCAL_RATE_LIMIT = "envoy.filters.http.local_ratelimit"
HEADER_MUTATION = "envoy.filters.http.header_mutation"
_RATE_LIMIT_DESCRIPTOR = "wakegate_model"
_UINT32_MAX = 2**32 - 1
_ALWAYS = {"default_value": {"numerator": 100, "denominator": "HUNDRED"}}


def envoy_rate_limited(models: Iterable[RoutedModel], settings: GatewaySettings) -> tuple[RoutedModel, ...]:
    """Models whose per-model bucket Envoy's local rate limit keeps (and extproc's does not, for
    the requests Envoy counted): every model with a limit, native or decided, wherever the
    gateway lets Envoy route before extproc (`native_allowed`: it has the keys extproc checks).
    One bucket in Envoy, before either extproc, is what keeps a limit exact while Envoy sends a
    request to the standby extproc (at start-up, on a failover); each extproc's own buckets
    would split it. A model with adapters stays with extproc: requests naming an adapter reach
    only extproc, and two buckets would split its limit just the same. Like may_go_native it
    follows the manifests only, so the listener that holds the buckets does not change when a
    model wakes or sleeps."""
    if not settings.native_allowed:
        return ()
    # With the gateway-wide bucket in Envoy every model's requests draw from it (a model without
    # a limit of its own: the global bucket only).
    limited = (
        m
        for m in models
        if (m.requests_per_second > 0 or settings.global_rps > 0) and not (m.adapters or m.lora_adapters)
    )
    return tuple(sorted(limited, key=lambda m: m.key))


def token_bucket(rate: float, burst: float) -> dict[str, Any]:
    """Envoy's TokenBucket closest to extproc's bucket of `rate` tokens/s and `burst` (0: max(1,
    rate); extproc/ratelimit.py). Envoy refills continuously at tokens_per_fill / fill_interval
    (fill_interval in whole milliseconds, at least 50 ms): tokens_per_fill = ceil(rate) keeps the
    interval at 1 s or more, so rounding it to the millisecond changes the rate by 0.05% at most.
    Envoy's max_tokens is a whole number: a fractional burst is rounded down (never more admitted
    at once than extproc would)."""
    tokens_per_fill = min(max(1, math.ceil(rate)), _UINT32_MAX)
    interval_ms = max(50, round(1000 * tokens_per_fill / rate))
    return {
        "max_tokens": min(max(1, math.floor(burst or max(1.0, rate))), _UINT32_MAX),
        "tokens_per_fill": tokens_per_fill,
        "fill_interval": f"{interval_ms / 1000:.3f}s",
    }


def refused_retry_after(rate: float) -> str:
    """The Retry-After of a request Envoy's bucket refuses. Envoy cannot compute the wait as
    extproc does (ceil((1 - tokens) / rate), at least 1): it answers the longest such wait,
    ceil(1 / rate), the same "1" extproc answers for any rate of 1/s or more."""
    return str(max(1, math.ceil(1 / rate - 1e-9)))


def _rate_limit_metadata(model: RoutedModel, global_rps: float = 0.0) -> dict[str, Any]:
    """The buckets a route draws from: the model's where it has a limit (`model`), the gateway-wide
    one where Envoy keeps it (`global`); a refusal's Retry-After is the slower bucket's."""
    rates = [rate for rate in (model.requests_per_second, global_rps) if rate > 0]
    found: dict[str, str] = {"retry_after": refused_retry_after(min(rates))}
    if model.requests_per_second > 0:
        found["model"] = model.key
    if global_rps > 0:
        found["global"] = _GLOBAL
    return {"filter_metadata": {RATE_LIMIT_METADATA: found}}


#: The descriptor value of the gateway-wide bucket (`--global-rps`) in Envoy's local rate limit.
_GLOBAL = "all"
_GLOBAL_DESCRIPTOR = "wakegate_global"


def _descriptor_of(key: str, descriptor: str) -> dict[str, Any]:
    """A rate_limits entry: the descriptor `descriptor` valued with the route's metadata `key` (none
    for a route without it)."""
    return {
        "actions": [
            {
                "metadata": {
                    "descriptor_key": descriptor,
                    "metadata_key": {"key": RATE_LIMIT_METADATA, "path": [{"key": key}]},
                    "source": "ROUTE_ENTRY",
                }
            }
        ]
    }


def _local_rate_limit(limited: Sequence[RoutedModel], settings: GatewaySettings) -> dict[str, Any]:
    """Envoy's local rate limit with one bucket per model of `limited` that has a limit, shared by
    every route whose metadata names the model (native and decided alike), and the gateway-wide
    bucket where `settings` put it here, shared by every route whose metadata says `global`;
    requests of other routes take no token. Envoy tries the slower bucket first: a request it
    refuses takes nothing from the other. Its 429 is shaped by the local reply mapper
    (`RATE_LIMITED_REPLY`)."""
    has_global = settings.global_rps > 0
    glob = (
        [
            {
                "entries": [{"key": _GLOBAL_DESCRIPTOR, "value": _GLOBAL}],
                "token_bucket": token_bucket(settings.global_rps, settings.global_burst),
            }
        ]
        if has_global
        else []
    )
    return {
        "name": LOCAL_RATE_LIMIT,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
            "stat_prefix": "wakegate_models",
            "filter_enabled": _ALWAYS,
            "filter_enforced": _ALWAYS,
            "always_consume_default_token_bucket": False,
            "rate_limits": [
                _descriptor_of("model", _RATE_LIMIT_DESCRIPTOR),
                *([_descriptor_of("global", _GLOBAL_DESCRIPTOR)] if has_global else []),
            ],
            "descriptors": [
                *(
                    {
                        "entries": [{"key": _RATE_LIMIT_DESCRIPTOR, "value": m.key}],
                        "token_bucket": token_bucket(m.requests_per_second, m.burst),
                    }
                    for m in limited
                    if m.requests_per_second > 0
                ),
                *glob,
            ],
            "response_headers_to_add": [
                {
                    "header": {"key": "retry-after", "value": f"%METADATA(ROUTE:{RATE_LIMIT_METADATA}:retry_after)%"},
                    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                }
            ],
        },
    }


#: Sets RATE_COUNTED_HEADER where a decided route says so (`_counted`): extproc, next in the chain,
#: then takes no token of its own. No mutation of its own elsewhere.
_HEADER_MUTATION_FILTER = {
    "name": HEADER_MUTATION,
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
        "mutations": {},
    },
}

#: Envoy's own 429 (its local rate limit's) in extproc's words: the same code, type and message.
RATE_LIMITED_REPLY = _mapper(_status(429), "rate_limited", "rate limit exceeded; retry later", "rate_limit_error")


def _local_replies(rate_limited: bool, key_checks: bool = False) -> dict[str, Any]:
    """LOCAL_REPLY_CONFIG, with the mappers of Envoy's own refusals right after extproc's
    pass-through: api_key_auth's where native routes check keys, the 429 where Envoy keeps buckets
    (otherwise Envoy never answers those itself)."""
    if not rate_limited and not key_checks:
        return LOCAL_REPLY_CONFIG
    first, *rest = LOCAL_REPLY_CONFIG["mappers"]
    own = [*(_KEY_CHECK_REPLIES if key_checks else []), *([RATE_LIMITED_REPLY] if rate_limited else [])]
    return {**LOCAL_REPLY_CONFIG, "mappers": [first, *own, *rest]}


def listener(
    settings: GatewaySettings,
    native: bool = False,
    rate_limited: Sequence[RoutedModel] = (),
    *,
    replayed: bool = False,
) -> listener_pb2.Listener:
    """The gateway's listener; `native` (may_go_native) adds what native routes need, `rate_limited`
    (envoy_rate_limited) the buckets of those models, before extproc: a request over its model's
    limit is refused before it could wait for a cold start, as extproc refuses it. Buckets need
    what native routes need (the body's `model` read before extproc, keys checked first), so
    `rate_limited` alone sets up the listener as `native` does. `replayed`: the replay listener
    instead (`replay_listener`)."""
    native = native or bool(rate_limited)
    # With replay, a failed ext_proc stream lets the request go on to its undecided route, which
    # sends it through the replay listener (route_configuration); there, a failure is the 503.
    replays = settings.replay and not replayed
    http_filters: list[dict[str, Any]] = [
        *([_JSON_TO_METADATA_FILTER] if native else []),
        *([_API_KEY_AUTH_FILTER] if native and settings.key_checks else []),
        *([_local_rate_limit(rate_limited, settings), _HEADER_MUTATION_FILTER] if rate_limited else []),
        {
            "name": "envoy.filters.http.ext_proc",
            # With native routes, off unless the route turns it on (every route but the native
            # ones does, route_configuration): Envoy then does not even create the filter for a
            # native request, which cost ~50 us of Envoy CPU per request when each native route
            # only switched it off (docs/performance.md).
            **({"disabled": True} if native else {}),
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                "grpc_service": {
                    "envoy_grpc": {"cluster_name": contract.EXTPROC_CLUSTER},
                    "timeout": "5s",
                    # A stream that cannot reach an extproc (it just died, before health checks
                    # noticed) is opened again on the next priority: the standby. (A host
                    # predicate as well cost ~30 us of Envoy CPU per request and added nothing
                    # with one host per priority; docs/performance.md.)
                    "retry_policy": {
                        "num_retries": 2,
                        "retry_on": "connect-failure,refused-stream,reset",
                        "retry_back_off": {"base_interval": "0.01s", "max_interval": "0.05s"},
                        "retry_priority": {
                            "name": "envoy.retry_priorities.previous_priorities",
                            "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.retry.priority.previous_priorities.v3"
                                ".PreviousPrioritiesConfig",
                                "update_frequency": 1,
                            },
                        },
                    },
                },
                "failure_mode_allow": replays,
                # Bodies are buffered unless the route says the model is named in the request's
                # headers (route_configuration): a body that arrives while extproc decides on the
                # headers is then held under the size limit (413 past it). Buffering only once
                # extproc asked for it left an oversized body that had already arrived paused by
                # flow control, with no answer (docs/decisions.md).
                "processing_mode": _processing_mode("BUFFERED"),
                "allow_mode_override": True,
                # What a budgeted tenant's response used (extproc/budget.py), for the access log
                # that carries it to every extproc.
                "metadata_options": {"receiving_namespaces": {"untyped": [contract.USAGE_METADATA_NAMESPACE]}},
                "message_timeout": f"{settings.extproc_message_timeout_ms / 1000:.3f}s",
                "max_message_timeout": f"{settings.max_hold_seconds}s",
                "route_cache_action": "CLEAR",
            },
        },
        *settings.extra_listener_filters,
        ROUTER_FILTER,
    ]
    hcm = {
        "stat_prefix": "wakegate_replayed" if replayed else "wakegate",
        "codec_type": "AUTO",
        "rds": {"route_config_name": ROUTE_NAME, "config_source": {"ads": {}, "resource_api_version": "V3"}},
        "http_filters": http_filters,
        "stream_idle_timeout": f"{settings.stream_idle_timeout_s}s",
        "request_timeout": "0s",
        "normalize_path": True,
        "merge_slashes": True,
        "path_with_escaped_slashes_action": "KEEP_UNCHANGED",
        "use_remote_address": True,
        "local_reply_config": _local_replies(bool(rate_limited), native and settings.key_checks),
        # A malformed HTTP/2 request resets its own stream (RFC 9113, 8.1.1), not the connection
        # with every other stream on it; HTTP/1 gets its shaped 400 and the connection closes.
        "http2_protocol_options": {"override_stream_error_on_invalid_http_message": True},
        # Request ids are Envoy's own UUIDs: a client's x-request-id is dropped before Envoy assigns
        # one, so extproc can key in-flight requests on it (extproc/completions.py).
        "early_header_mutation_extensions": [
            {
                "name": "envoy.http.early_header_mutation.header_mutation",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3"
                    ".HeaderMutation",
                    # With native routes, a client's x-wakegate-native would hide its request from
                    # extproc's access log (see _completion_log), and its destination header would
                    # pick the backend on a native route (extproc drops it on the decided path):
                    # only Envoy's native routes and extproc set them. Its cluster header is
                    # dropped too: extproc is off by default there, and only extproc names a
                    # cluster (the cluster_header route turns extproc on all the same).
                    "mutations": [
                        {"remove": "x-request-id"},
                        *(
                            [
                                {"remove": contract.NATIVE_HEADER},
                                {"remove": contract.DESTINATION_HEADER},
                                {"remove": contract.CLUSTER_HEADER},
                            ]
                            if native
                            else []
                        ),
                        # A client's copy would spare its request extproc's token; on the replay
                        # listener it is the gateway's own, from the first pass.
                        *([{"remove": contract.RATE_COUNTED_HEADER}] if rate_limited and not replayed else []),
                        # Only the gateway's replay route sends a request through again.
                        *([{"remove": contract.REPLAY_HEADER}] if replays else []),
                    ],
                },
            }
        ],
        "access_log": [_completion_log(cluster, native) for cluster in settings.access_log_clusters],
    }
    config = http_listener(LISTENER_NAME, settings.listen_host, settings.listen_port, hcm)
    if replayed:
        del config["address"]
        config.update(name=contract.REPLAY_LISTENER, internal_listener={})
    return _parse(
        listener_pb2.Listener(),
        {**config, "per_connection_buffer_limit_bytes": settings.max_request_bytes + 64 * 1024},
    )


def replay_listener(
    settings: GatewaySettings, native: bool = False, rate_limited: Sequence[RoutedModel] = ()
) -> listener_pb2.Listener:
    """The internal listener (reached only from this Envoy, through REPLAY_CLUSTER) a request goes
    through again when its ext_proc stream failed before extproc decided it: the same filters and
    routes as the gateway's listener, so the request is checked, decided and held anew by
    whichever extproc Envoy reaches now. What differs: the gateway's own marks stay on the request
    (REPLAY_HEADER, which picks the replay route, and RATE_COUNTED_HEADER: its token was taken on
    the first pass), and a failed ext_proc stream here is the retriable 503 marked unserved,
    which the first pass's replay route retries (route_configuration)."""
    return listener(settings, native, rate_limited, replayed=True)


_MODEL_HEADER_SET = {"name": contract.MODEL_HEADER, "string_match": {"safe_regex": {"regex": ".+"}}}
_NO_ROUTE: dict[str, Any] = {
    "direct_response": {
        "status": 404,
        # Shaped by the listener's local_reply_config (404: `no_route`).
        "body": {"inline_string": "no route"},
    }
}
_JSON_TO_METADATA_OFF = {
    "envoy.filters.http.json_to_metadata": {
        "@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig",
        "disabled": True,
    }
}
#: Turns extproc on for a route where the listener has it off by default (a listener with native
#: routes, `listener`): every route but the native ones carries this or another extproc config.
_EXTPROC_ON = {
    "envoy.filters.http.ext_proc": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
        "overrides": {},
    }
}
_EXTPROC_OFF = {
    "envoy.filters.http.ext_proc": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
        "disabled": True,
    }
}
_STREAM_BODY: dict[str, Any] = {
    "typed_per_filter_config": {
        "envoy.filters.http.ext_proc": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
            "overrides": {"processing_mode": _processing_mode("NONE")},
        },
    }
}


_POST = {"name": ":method", "string_match": {"exact": "POST"}}
_NO_MODEL_HEADER = {"name": contract.MODEL_HEADER, "present_match": True, "invert_match": True}
#: Names a native /model/<name>/ route is made for: what needs no percent-decoding in a path.
_PLAIN_NAME = re.compile(r"[A-Za-z0-9._~:@!$&'()*+,;=-]+")


#: The one Authorization form both paths read alike: api_key_auth takes what follows exactly
#: "Bearer " (a bare key too), extproc also a lower-case scheme and several spaces, and no bare
#: key. With key checks a native route matches only this form; any other goes to extproc.
_BEARER_KEY = {"name": "authorization", "string_match": {"safe_regex": {"regex": r"Bearer \S+"}}}
#: allowed_clients of a model no key may use (none given would allow every key).
_NO_CLIENT = "-"


def _key_check(keys: Sequence[GatewayKey], model: RoutedModel | None = None, hide: bool = True) -> dict[str, Any]:
    """A route's api_key_auth: every key. For a `model`, only the keys whose scope has the model
    allowed, and (`hide`, a native route) the gateway's key kept from the backend (as extproc
    removes it); without a model, any key passes and extproc gets the header for its own check."""
    check: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.api_key_auth.v3.ApiKeyAuthPerRoute",
        "credentials": [{"key": k.key, "client": k.client} for k in keys],
        "key_sources": [{"header": "authorization"}],
    }
    if model is not None:
        own_name = model.names[0] if model.names else model.key
        allowed = [k.client for k in keys if k.scope.allows(model.key, own_name)]
        check["allowed_clients"] = allowed or [_NO_CLIENT]
        if hide:
            check["forwarding"] = {"hide_credentials": True}
    return {API_KEY_AUTH: check}


def _bearer_catch_all(keys: Sequence[GatewayKey]) -> dict[str, Any]:
    """The catch-all of POSTs in the Bearer form where body routes check keys. Envoy makes a
    request's filters from the route it first matches, before json_to_metadata has read the body:
    api_key_auth exists for a body-named request only if that first route asks for it. This one
    does, with every key allowed, so a request the body then routes natively is checked by its
    native route, and one the body leaves here goes to extproc (an unknown key: the same 401)."""
    return {
        **_NO_ROUTE,
        "name": "bearer",
        "match": {"prefix": "/", "headers": [_POST, _BEARER_KEY]},
        "typed_per_filter_config": {**_key_check(keys), **_EXTPROC_ON},
    }


def _says_as_python(name: str) -> bool:
    """Whether `model '%ROUTE_NAME%'` is extproc's `model {name!r}` for this name."""
    return repr(name) == f"'{name}'"


def _routable_names(model: RoutedModel, keys: Sequence[GatewayKey] | None) -> list[str]:
    """The names of `model` Envoy's routes may match: with `keys`, only those whose 404 Envoy can
    word as extproc does (`_says_as_python`); the others stay with extproc."""
    return [n for n in model.names if keys is None or _says_as_python(n)]


def _native(
    model: RoutedModel,
    name: str,
    match: dict[str, Any],
    extra: dict[str, Any] | None = None,
    keys: Sequence[GatewayKey] | None = None,
    *,
    second: bool = False,
    limited: bool = False,
) -> dict[str, Any]:
    """A route Envoy serves alone: straight to the model's cluster, extproc off, marked for the log.
    Named after the model name it matches; `keys` (not None): it checks them, in Bearer form only.
    `second`: a request meets it only after another route (the body routes, once json_to_metadata
    has read the body), which has turned extproc on; it is switched off here. `limited`: it draws
    from the model's bucket in Envoy's local rate limit."""
    if keys is not None:
        match = {**match, "headers": [*match["headers"], _BEARER_KEY]}
    return {
        **({"metadata": _rate_limit_metadata(model)} if limited else {}),
        "name": name,
        "match": match,
        "route": {"cluster": model.cluster, "timeout": "0s", **(extra or {})},
        "request_headers_to_add": [
            {"header": {"key": contract.NATIVE_HEADER, "value": "1"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
        ],
        # A route a request meets first names no extproc config at all: the listener has extproc
        # off by default, and any config of it here (even one saying disabled) would have Envoy
        # create the filter for the request (docs/performance.md, "The native path").
        "typed_per_filter_config": {
            **(_EXTPROC_OFF if second else {}),
            **_JSON_TO_METADATA_OFF,
            **(_key_check(keys, model) if keys is not None else {}),
        },
    }


def _native_routes(
    models: Sequence[RoutedModel],
    keys: Sequence[GatewayKey] | None = None,
    limited: AbstractSet[str] = frozenset(),
) -> tuple[list[Any], list[Any], list[Any]]:
    """(by X-Model-ID, by /model/<name>/ path, by the body's `model`) routes of the native models.

    Only POSTs (extproc answers GETs like /v1/models itself). Each kind goes right before the
    decided route of the same kind, so the header beats the path beats the body, as in extproc.
    The body route takes only the name the engine serves: any other name needs extproc's
    rewrite of `model` (a header or path names the model without touching the body, as today).
    With `keys`, a name whose 404 Envoy could not word as extproc does stays decided.
    """
    by_header, by_path, by_body = [], [], []
    for m in sorted(models, key=lambda m: m.key):
        counted = m.key in limited and m.requests_per_second > 0  # a native route has no global bucket
        names = _routable_names(m, keys)
        for name in names:
            by_header.append(_native(m, name, _by_header(name), keys=keys, limited=counted))
            if _PLAIN_NAME.fullmatch(name):
                by_path.append(_native(m, name, _by_path(name), {"prefix_rewrite": "/"}, keys=keys, limited=counted))
        if m.served_name in names:
            by_body.append(_native(m, m.served_name, _by_body(m.served_name), keys=keys, second=True, limited=counted))
    return by_header, by_path, by_body


def _by_header(name: str) -> dict[str, Any]:
    return {"prefix": "/", "headers": [{"name": contract.MODEL_HEADER, "string_match": {"exact": name}}, _POST]}


def _by_path(name: str) -> dict[str, Any]:
    return {"prefix": f"{contract.MODEL_PATH_PREFIX}{name}/", "headers": [_NO_MODEL_HEADER, _POST]}


def _by_body(name: str) -> dict[str, Any]:
    return {
        "prefix": "/",
        "headers": [_NO_MODEL_HEADER, _POST],
        "dynamic_metadata": [
            {
                "filter": contract.NATIVE_METADATA_NAMESPACE,
                "path": [{"key": "model"}],
                "value": {"string_match": {"exact": name}},
            }
        ],
    }


def _counted(
    model: RoutedModel,
    name: str,
    match: dict[str, Any],
    per_filter: dict[str, Any],
    keys: Sequence[GatewayKey] | None = None,
    global_rps: float = 0.0,
) -> dict[str, Any]:
    """A decided route (extproc decides, as on the catch-all) that draws the request's token from the
    model's bucket in Envoy (and the gateway-wide one, with `global_rps`) and tells extproc so
    (RATE_COUNTED_HEADER). With `keys` it takes only
    the Bearer form and Envoy checks the key and its scope first (a request refused for its key
    spends no token); the key stays on the request, for extproc's own check."""
    if keys is not None:
        match = {**match, "headers": [*match["headers"], _BEARER_KEY]}
    mark = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutationPerRoute",
        "mutations": {
            "request_mutations": [
                {
                    "append": {
                        "header": {"key": contract.RATE_COUNTED_HEADER, "value": model.key},
                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                    }
                }
            ]
        },
    }
    return {
        **_NO_ROUTE,
        "name": name,
        "metadata": _rate_limit_metadata(model, global_rps),
        "match": match,
        "typed_per_filter_config": {
            **_EXTPROC_ON,
            **per_filter,
            **_JSON_TO_METADATA_OFF,
            HEADER_MUTATION: mark,
            **(_key_check(keys, model, hide=False) if keys is not None else {}),
        },
    }


def _counted_routes(
    limited: Sequence[RoutedModel],
    native: AbstractSet[str],
    keys: Sequence[GatewayKey] | None = None,
    global_rps: float = 0.0,
) -> tuple[list[Any], list[Any], list[Any]]:
    """(by X-Model-ID, by /model/<name>/ path, by the body's `model`) decided routes of the models
    whose bucket Envoy keeps, for every name, each kind right after its native twins: the POSTs
    they match (a native model's alias in the body, any name while the model is cold) take their
    token in Envoy, as a native request does. What none matches (other methods, a multipart form's
    `model`, a name the path can only carry %-encoded) takes its token in extproc."""
    by_header, by_path, by_body = [], [], []
    for m in limited:
        warm = m.key in native
        for name in _routable_names(m, keys):  # extproc counts the others
            if not warm:  # a warm model's native routes take these
                streamed = _STREAM_BODY["typed_per_filter_config"]
                by_header.append(_counted(m, name, _by_header(name), streamed, keys, global_rps))
                if _PLAIN_NAME.fullmatch(name):
                    by_path.append(_counted(m, name, _by_path(name), streamed, keys, global_rps))
            if not (warm and name == m.served_name):
                by_body.append(_counted(m, name, _by_body(name), {}, keys, global_rps))
    return by_header, by_path, by_body


def route_configuration(
    settings: GatewaySettings,
    native: Sequence[RoutedModel] = (),
    *,
    body_metadata: bool = False,
    keys: Sequence[GatewayKey] = (),
    rate_limited: Sequence[RoutedModel] = (),
) -> route_pb2.RouteConfiguration:
    """The one route table. `native`: the models Envoy routes alone (native_keys); every other
    request finds no cluster until extproc names one. `body_metadata`: the listener has the
    json_to_metadata filter (may_go_native), which every route but the catch-all turns off.
    `keys`: the key file's, which native routes check where `settings.key_checks` (none there:
    every native request is refused, as extproc refuses all with an empty file).
    `rate_limited`: the models whose bucket Envoy keeps (envoy_rate_limited)."""
    off = _JSON_TO_METADATA_OFF if body_metadata or native or rate_limited else {}
    extra: dict[str, Any] = {}
    if settings.upstream_header:
        extra["response_headers_to_add"] = [
            {
                "header": {"key": UPSTREAM_HEADER, "value": "%UPSTREAM_REMOTE_ADDRESS%"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            }
        ]
    checked = keys if settings.key_checks else None
    by_header, by_path, by_body = _native_routes(native, checked, {m.key for m in rate_limited})
    counted_header, counted_path, counted_body = _counted_routes(
        rate_limited, {m.key for m in native}, checked, settings.global_rps
    )
    stream_body = {"typed_per_filter_config": {**_STREAM_BODY["typed_per_filter_config"], **off}}
    # With native routes possible, extproc is off in the listener unless a route turns it on.
    on = _EXTPROC_ON if off else {}
    catch_all: dict[str, Any] = {**_NO_ROUTE, "match": {"prefix": "/"}}
    if off and not native and not rate_limited:
        # With a native or rate-limited model, the body's `model` is read into metadata here, for
        # the body routes.
        catch_all["typed_per_filter_config"] = {**off, **on}
    elif on:
        catch_all["typed_per_filter_config"] = on
    routes: list[dict[str, Any]] = [
        {
            "match": {
                "prefix": "/",
                "headers": [{"name": contract.CLUSTER_HEADER, "present_match": True}],
            },
            "route": {
                "cluster_header": contract.CLUSTER_HEADER,
                "timeout": "0s",
                **_retry_policy(settings.upstream_retries, settings.upstream_retry_on),
            },
            **({"typed_per_filter_config": {**off, **on}} if off else {}),
        },
        # Before extproc has named a cluster: these pick how its filter treats the
        # body. A model named by the X-Model-ID header or a /model/<name>/ path
        # needs no body, so it streams through; everything else is buffered.
        *by_header,
        *counted_header,
        {**_NO_ROUTE, "match": {"prefix": "/", "headers": [_MODEL_HEADER_SET]}, **stream_body},
        *by_path,
        *counted_path,
        {**_NO_ROUTE, "match": {"prefix": contract.MODEL_PATH_PREFIX}, **stream_body},
        *by_body,
        *counted_body,
        *([_bearer_catch_all(keys)] if settings.key_checks and (by_body or counted_body) else []),
        catch_all,
    ]
    # Only this gateway's own replies may say a request reached no model server.
    unserved: dict[str, Any] = {"response_headers_to_remove": [contract.UNSERVED_HEADER]}
    if settings.replay:
        # Dropped from what model servers answer, route by route: a reply the replay listener
        # made keeps its mark through the first pass's replay route.
        routes = [
            {**routes[0], **unserved},
            {**_NO_ROUTE, "match": {"prefix": "/", "headers": [_REPLAYED]}, "typed_per_filter_config": {**off, **on}},
            *(_replays(r) if "direct_response" in r else {**r, **unserved} for r in routes[1:]),
        ]
        unserved = {}
    return _parse(
        route_pb2.RouteConfiguration(),
        {
            **extra,
            **unserved,
            "name": ROUTE_NAME,
            "virtual_hosts": [{"name": "models", "domains": ["*"], "routes": routes}],
        },
    )


_REPLAYED = {"name": contract.REPLAY_HEADER, "present_match": True}
#: Sends of one request through the replay listener at most. Each one that meets no extproc fails
#: within milliseconds; with the back-off below they span about 8 s: long enough for `up` to
#: restart an extproc that died while the other one was gone too.
REPLAY_ATTEMPTS = 30


def _replays(route: dict[str, Any]) -> dict[str, Any]:
    """An undecided route (one extproc decides on and names the cluster for) that, when it is
    reached after all, sends the request through the replay listener: that happens only when the
    request's ext_proc stream failed before extproc decided it (the listener lets such a request
    go on, `listener`), so no model server has seen it. Retried while the replay listener answers
    that no extproc could decide it (the unserved mark): each send is decided anew, by whichever
    extproc answers then. On the replay listener itself, the replayed route above takes the
    request first (a request is sent through again once at most)."""
    replayed = {k: v for k, v in route.items() if k != "direct_response"}
    return {
        **replayed,
        "route": {
            "cluster": contract.REPLAY_CLUSTER,
            "timeout": "0s",
            "retry_policy": {
                "retry_on": "retriable-headers,connect-failure,reset-before-request",
                "retriable_headers": [{"name": contract.UNSERVED_HEADER, "string_match": {"exact": "1"}}],
                "num_retries": REPLAY_ATTEMPTS,
                "retry_back_off": {"base_interval": "0.05s", "max_interval": "0.4s"},
            },
        },
        "request_headers_to_add": [
            {"header": {"key": contract.REPLAY_HEADER, "value": "1"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
        ],
    }


def _retry_policy(retries: int, retry_on: str) -> dict[str, Any]:
    """Retries before the response began (what `retry_on` allows), each on a host not tried yet
    (the pick's fallbacks in the destination header, `ModelRoute.fallback_endpoints`). An
    upstream gateway's reply marked unserved (contract.UNSERVED_HEADER: it reached no model
    server) is always retried too."""
    if retries <= 0:
        return {}
    return {
        "retry_policy": {
            "retry_on": f"{retry_on},retriable-headers",
            "retriable_headers": [{"name": contract.UNSERVED_HEADER, "string_match": {"exact": "1"}}],
            "num_retries": retries,
            "retry_back_off": {"base_interval": "0.01s", "max_interval": "0.05s"},
            "retry_host_predicate": [
                {
                    "name": "envoy.retry_host_predicates.previous_hosts",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3"
                        ".PreviousHostsPredicate"
                    },
                }
            ],
            "host_selection_retry_max_attempts": 5,
        }
    }


_ROUND_ROBIN_TYPE = "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"


def envoy_always_picks(model: RoutedModel) -> bool:
    """Whether extproc never names an endpoint for `model`: round robin with no scoring and no
    adapters, so every pick is Envoy's own. Its cluster then has no override_host wrapper
    (a header and a metadata lookup on every request, native or decided, for nothing)."""
    return (
        model.strategy == "round-robin"
        and not model.profile
        and not model.weights
        and not model.adapters
        and not model.lora_adapters
        and not model.adapters_on_demand
    )


def model_cluster(model: RoutedModel, settings: GatewaySettings) -> cluster_pb2.Cluster:
    fallback = (
        "envoy.load_balancing_policies.least_request"
        if model.strategy == "least-loaded"
        else "envoy.load_balancing_policies.round_robin"
    )
    # least-loaded: every endpoint compared (not two sampled), ties split at random, so Envoy's own
    # pick, which a native least-loaded model gets, is the endpoint with the fewest of its requests.
    fallback_config: dict[str, Any] = (
        {
            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest",
            "selection_method": "FULL_SCAN",
        }
        if model.strategy == "least-loaded"
        else {"@type": _ROUND_ROBIN_TYPE}
    )
    return _parse(
        cluster_pb2.Cluster(),
        {
            "name": model.cluster,
            "alt_stat_name": stat_name(model.key),
            "type": "EDS",
            "eds_cluster_config": {"eds_config": {"ads": {}, "resource_api_version": "V3"}},
            "connect_timeout": f"{settings.upstream_connect_timeout_ms / 1000:.3f}s",
            "per_connection_buffer_limit_bytes": 1024 * 1024,
            "circuit_breakers": {
                "thresholds": [
                    {
                        # HTTP/1.1 upstreams take one connection per request in flight: past this
                        # many, requests wait in Envoy's queue instead of opening more sockets
                        # (thousands of held requests released at once would exhaust fds).
                        "max_connections": settings.upstream_max_connections,
                        "max_pending_requests": 100000,
                        "max_requests": 100000,
                        "max_retries": 3,
                    }
                ]
            },
            "load_balancing_policy": _round_robin_only()
            if envoy_always_picks(model)
            else {
                "policies": [
                    {
                        "typed_extension_config": {
                            "name": "envoy.load_balancing_policies.override_host",
                            "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies"
                                ".override_host.v3.OverrideHost",
                                "override_host_sources": [
                                    {"header": contract.DESTINATION_HEADER},
                                    {
                                        "metadata": {
                                            "key": contract.LB_METADATA_NAMESPACE,
                                            "path": [{"key": contract.DESTINATION_HEADER}],
                                        }
                                    },
                                ],
                                "fallback_policy": {
                                    "policies": [
                                        {
                                            "typed_extension_config": {
                                                "name": fallback,
                                                "typed_config": fallback_config,
                                            }
                                        }
                                    ]
                                },
                            },
                        }
                    }
                ]
            },
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "common_http_protocol_options": {"idle_timeout": "60s"},
                    "explicit_http_config": {"http_protocol_options": {}},
                    **(_endpoint_authorization() if model.endpoint_authorization else {}),
                }
            },
            **(_transport_socket_matches(model.endpoint_tls) if model.endpoint_tls else {}),
        },
    )


def _round_robin_only() -> dict[str, Any]:
    """Envoy's round robin alone (`envoy_always_picks`)."""
    return {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.round_robin",
                    "typed_config": {"@type": _ROUND_ROBIN_TYPE},
                }
            }
        ]
    }


#: Endpoint metadata key the TLS transport socket matches on (`endpoint_tls`).
TLS_MATCH_KEY = "wakegate.member"


def _transport_socket_matches(endpoints: Iterable[tuple[str, int, UpstreamTls]]) -> dict[str, Any]:
    """One TLS transport socket per member (matched by its endpoints' metadata), each trusting only
    that member's CA and checking its name; endpoints without the metadata stay plain text."""
    matches = []
    for tls in sorted({t for _, _, t in endpoints}, key=lambda t: t.name):
        san = ("DNS", tls.server_name) if tls.server_name else ("IP_ADDRESS", tls.ip_san or "")
        common: dict[str, Any] = {
            "validation_context": {
                "trusted_ca": {"filename": tls.ca_file},
                "match_typed_subject_alt_names": [{"san_type": san[0], "matcher": {"exact": san[1]}}],
            }
        }
        if tls.cert_file and tls.key_file:
            common["tls_certificates"] = [
                {"certificate_chain": {"filename": tls.cert_file}, "private_key": {"filename": tls.key_file}}
            ]
        context: dict[str, Any] = {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "common_tls_context": common,
        }
        if tls.server_name:
            context["sni"] = tls.server_name
        matches.append(
            {
                "name": f"tls-{tls.name}",
                "match": {TLS_MATCH_KEY: tls.name},
                "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": context},
            }
        )
    return {"transport_socket_matches": matches}


#: EDS metadata namespace of what Envoy adds to requests to one endpoint (`endpoint_authorization`).
ENDPOINT_METADATA = "wakegate"


def _endpoint_metadata(model: RoutedModel) -> dict[tuple[str, int], dict[str, Any]]:
    """Each endpoint's EDS metadata: its authorization (`endpoint_authorization`), its TLS match."""
    metadata: dict[tuple[str, int], dict[str, Any]] = {}
    for ip, port, value in model.endpoint_authorization:
        if value:
            metadata.setdefault((ip, port), {})[ENDPOINT_METADATA] = {"authorization": value}
    for ip, port, tls in model.endpoint_tls:
        metadata.setdefault((ip, port), {})["envoy.transport_socket_match"] = {TLS_MATCH_KEY: tls.name}
    return metadata


def load_assignment(model: RoutedModel) -> endpoint_pb2.ClusterLoadAssignment:
    metadata = _endpoint_metadata(model)
    return _parse(
        endpoint_pb2.ClusterLoadAssignment(),
        {
            "cluster_name": model.cluster,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {"address": {"socket_address": {"address": ip, "port_value": port}}},
                            "health_status": "HEALTHY",
                            **({"metadata": {"filter_metadata": found}} if (found := metadata.get((ip, port))) else {}),
                        }
                        for ip, port in sorted(model.endpoints)
                    ]
                }
            ],
        },
    )


def _endpoint_authorization() -> dict[str, Any]:
    """Upstream filters that set `authorization` from the picked endpoint's EDS metadata (a member
    gateway's token), replacing the client's; no metadata, no header."""
    return {
        "http_filters": [
            {
                "name": "envoy.filters.http.header_mutation",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
                    "mutations": {
                        "request_mutations": [
                            {
                                "append": {
                                    "header": {
                                        "key": "authorization",
                                        "value": f'%UPSTREAM_METADATA(["{ENDPOINT_METADATA}", "authorization"])%',
                                    },
                                    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                                }
                            }
                        ]
                    },
                },
            },
            {
                "name": "envoy.filters.http.upstream_codec",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.upstream_codec.v3.UpstreamCodec"
                },
            },
        ]
    }


def model_route(
    model: RoutedModel, counted_by_envoy: bool = False, global_counted: bool = False
) -> routing_pb2.ModelRoute:
    """extproc's route of `model`; `counted_by_envoy`: Envoy keeps its bucket (envoy_rate_limited),
    and with `global_counted` the gateway-wide one for the same requests.

    An adapter's holders are only those among the route's endpoints: a gateway whose Envoy has
    not confirmed an endpoint yet (`for_gateway`) sees neither the endpoint nor it as a holder."""
    routable = {f"{ip}:{port}" for ip, port in model.endpoints}
    return routing_pb2.ModelRoute(
        key=model.key,
        names=list(model.names),
        served_name=model.served_name,
        lora_adapters=list(model.lora_adapters),
        adapters=[
            routing_pb2.LoRAAdapterRoute(
                name=a.name,
                names=list(a.names),
                served_name=a.served_name,
                lora_id=a.lora_id if a.lora_id >= 0 else None,
                scale=a.scale,
                endpoints=[e for e in a.endpoints if e in routable],
                failed_loads=a.failed_loads,
                last_failure=a.last_failure,
            )
            for a in model.adapters
        ],
        adapters_on_demand=model.adapters_on_demand,
        adapter_placement=model.adapter_placement if model.adapters_on_demand else "",
        cluster=model.cluster,
        strategy=contract.STRATEGIES[model.strategy],
        profile=model.profile,
        weights=dict(model.weights),
        kv_events_offset=model.kv_events_offset,
        kv_events_replay_offset=model.kv_events_replay_offset,
        tokenizer=model.tokenizer,
        fallback_endpoints=model.fallback_endpoints,
        rate_limit=routing_pb2.RateLimit(
            requests_per_second=model.requests_per_second,
            burst=model.burst,
            counted_by_envoy=counted_by_envoy,
            global_counted_by_envoy=counted_by_envoy and global_counted,
        ),
        endpoints=_route_endpoints(model),
        cold=routing_pb2.ColdPolicy(
            mode=contract.COLD_MODES[model.cold_mode],
            max_queue=model.max_queue,
            activation_timeout_ms=int(model.activation_timeout_s * 1000),
        ),
        generation=model.generation,
        failed_activations=model.failed_activations,
        last_failure=model.last_failure,
        failure_code=model.failure_code,
        admitted=model.admitted,
        path=model.path,
        flow=_flow(model.flow),
    )


def _flow(flow: RoutedFlow | None) -> routing_pb2.FlowControl | None:
    if flow is None:
        return None
    return routing_pb2.FlowControl(
        enabled=True,
        band=flow.band,
        max_queue=flow.max_queue,
        queue_timeout_ms=int(flow.queue_timeout_s * 1000),
        max_waiting=flow.max_waiting,
        max_kv_usage=flow.max_kv_usage,
        max_in_flight=flow.max_in_flight,
    )


def _route_endpoints(model: RoutedModel) -> list[routing_pb2.Endpoint]:
    loads = {(ip, port): queue for ip, port, queue in model.loads}
    weights = {(ip, port): weight for ip, port, weight in model.endpoint_weights}
    return [
        routing_pb2.Endpoint(
            address=ip, port=port, engine_load=loads.get((ip, port), 0), weight=weights.get((ip, port), 0)
        )
        for ip, port in sorted(model.endpoints)
    ]


class BuildMemo:
    """What the last `build` made, reused by the next one for whatever did not change.

    A change to one model rebuilds that model's cluster, endpoints and route and nothing else;
    the listener and the route table are rebuilt only when their own inputs change. A model
    counts as unchanged when it is the same object as last time (the feeders keep unchanged
    models as they are) or equal to it.
    """

    def __init__(self) -> None:
        #: model key -> (model, settings, counted by Envoy, cluster, load assignment, route)
        self.models: dict[str, tuple[RoutedModel, GatewaySettings, bool, Message, Message, Message]] = {}
        self.listener: tuple[tuple[Any, ...], Message] | None = None
        self.replay: tuple[tuple[Any, ...], Message] | None = None
        self.routes: tuple[tuple[Any, ...], Message] | None = None
        #: Per-model messages built (not reused) by the last build: what a change cost.
        self.rebuilt = 0
        self._last: dict[str, Mapping[str, Message]] = {}

    def model(self, m: RoutedModel, settings: GatewaySettings, counted: bool) -> tuple[Message, Message, Message]:
        found = self.models.get(m.key)
        if (
            found is not None
            and (found[0] is m or found[0] == m)
            and (found[1] is settings or found[1] == settings)
            and found[2] == counted
        ):
            return found[3], found[4], found[5]
        self.rebuilt += 1
        made = (model_cluster(m, settings), load_assignment(m), model_route(m, counted, settings.global_rps > 0))
        self.models[m.key] = (m, settings, counted, *made)
        return made

    def same(self, kind: str, made: dict[str, Message]) -> Mapping[str, Message]:
        """`made`, or the equal mapping of the last build (same names, same message objects)."""
        last = self._last.get(kind)
        if last is not None and len(last) == len(made) and all(last.get(n) is m for n, m in made.items()):
            return last
        self._last[kind] = made
        return made

    def keep_only(self, keys: AbstractSet[str]) -> None:
        for key in [k for k in self.models if k not in keys]:
            del self.models[key]


def _memoised(
    slot: tuple[tuple[Any, ...], Message] | None, inputs: tuple[Any, ...], make: Callable[[], _M]
) -> tuple[tuple[tuple[Any, ...], Message], _M]:
    if slot is not None and slot[0] == inputs:
        return slot, slot[1]  # type: ignore[return-value]
    made = make()
    return (inputs, made), made


def build(
    models: Sequence[RoutedModel],
    settings: GatewaySettings,
    confirmed: Mapping[str, frozenset[tuple[str, int]]] | None = None,
    retained: Mapping[str, frozenset[tuple[str, int]]] | None = None,
    routed_natively: AbstractSet[str] | None = None,
    keys: Sequence[GatewayKey] = (),
    memo: BuildMemo | None = None,
) -> Resources:
    """Every resource for one consistent view of the fleet, as one gateway should see it.

    Without `confirmed`, `retained` and `routed_natively` this is the base snapshot: every ready
    endpoint, ungated. With them it is `for_gateway(build(models, settings), ...)`. `keys`: the
    API keys native routes check (`GatewaySettings.key_checks`). `memo`: what the last build
    with the same memo made, reused where its inputs did not change (the feeders keep one).
    """
    memo = memo if memo is not None else BuildMemo()
    memo.rebuilt = 0
    native = native_keys(models, settings)
    body_metadata = may_go_native(models, settings)
    limited = envoy_rate_limited(models, settings)
    chosen = tuple(m for m in models if m.key in native)
    keys = tuple(keys)
    memo.routes, routes = _memoised(
        memo.routes,
        (settings, chosen, body_metadata, keys, limited),
        lambda: route_configuration(settings, chosen, body_metadata=body_metadata, keys=keys, rate_limited=limited),
    )
    memo.listener, the_listener = _memoised(
        memo.listener, (settings, body_metadata, limited), lambda: listener(settings, body_metadata, limited)
    )
    listeners: dict[str, Message] = {LISTENER_NAME: the_listener}
    if settings.replay:
        memo.replay, listeners[contract.REPLAY_LISTENER] = _memoised(
            memo.replay, (settings, body_metadata, limited), lambda: replay_listener(settings, body_metadata, limited)
        )
    counted = {m.key for m in limited}
    clusters: dict[str, Message] = {}
    endpoints: dict[str, Message] = {}
    model_routes: dict[str, Message] = {}
    for m in models:
        clusters[m.cluster], endpoints[m.cluster], model_routes[m.key] = memo.model(m, settings, m.key in counted)
    if len(memo.models) > len(models):
        memo.keep_only({m.key for m in models})
    base = Resources(
        by_type={
            LISTENER: listeners,
            ROUTE: {ROUTE_NAME: routes},
            # The same mapping as last time where nothing in it changed: a stream can tell at once.
            CLUSTER: memo.same("clusters", clusters),
            ENDPOINT: memo.same("endpoints", endpoints),
            MODEL_ROUTE: memo.same("routes", model_routes),
        },
        native=native,
    )
    if confirmed is None and retained is None and routed_natively is None:
        return base
    return for_gateway(base, models, confirmed, retained, settings, routed_natively, keys)


def for_gateway(
    base: Resources,
    models: Sequence[RoutedModel],
    confirmed: Mapping[str, frozenset[tuple[str, int]]] | None,
    retained: Mapping[str, frozenset[tuple[str, int]]] | None,
    settings: GatewaySettings | None = None,
    routed_natively: AbstractSet[str] | None = None,
    keys: Sequence[GatewayKey] = (),
) -> Resources:
    """One gateway's view of `base` (built from the same `models` and `keys`), gated by its own
    acknowledgements.

    `confirmed` (cluster -> endpoints this gateway's Envoy has acknowledged) gates what its
    extproc sees: a new endpoint reaches extproc's route only once Envoy can route to it, so
    a held request is never flushed to a cluster that does not know the host yet. Clusters
    missing from `confirmed`, or no `confirmed` at all, are not gated (no Envoy to wait for).
    It gates the native routes the same way (native_keys): a model turns native only once its
    Envoy has one of its endpoints.

    `retained` (cluster -> endpoints this gateway's extproc may still pick) keeps a removed
    endpoint in its Envoy's cluster until that extproc has dropped it, so the other
    direction has no gap either. The backend is still draining meanwhile.

    `routed_natively` (clusters this gateway's Envoy has acknowledged native routes to) does
    the same for Envoy's own routes: a cluster keeps the endpoints its Envoy has until that
    Envoy has dropped its native routes, so a model's last endpoint leaves only after its
    requests go to extproc again (which holds them).

    Only the messages that differ from the base are rebuilt; in the steady state (every
    acknowledgement current) the base itself is returned.
    """
    base_endpoints = base.by_type[ENDPOINT]
    base_routes = base.by_type[MODEL_ROUTE]
    endpoints: dict[str, Message] | None = None  # copied on the first change only
    routes: dict[str, Message] | None = None
    route_config = base.by_type[ROUTE]
    native_clusters = routed_natively or frozenset()
    no_retained: Mapping[str, frozenset[tuple[str, int]]] = {}
    retained = retained or no_retained
    empty: frozenset[tuple[str, int]] = frozenset()
    # Per model a few set operations in C: with a thousand models a view costs about a millisecond.
    for m in models:
        cluster = m.cluster
        ready = m.endpoint_set
        held = retained.get(cluster)
        kept = held - ready if held is not None and not held <= ready else empty
        if not ready and not kept and cluster in native_clusters:
            kept = (confirmed or {}).get(cluster, empty)
        if kept:
            if endpoints is None:
                endpoints = dict(base_endpoints)
            endpoints[cluster] = load_assignment(replace(m, endpoints=tuple(sorted(ready | kept))))
        if confirmed is not None and ready:
            have = confirmed.get(cluster)
            if have is not None and not ready <= have:
                if routes is None:
                    routes = dict(base_routes)
                allowed = tuple(e for e in m.endpoints if e in have)
                rate = base_routes[m.key].rate_limit  # type: ignore[attr-defined]
                routes[m.key] = model_route(
                    replace(m, endpoints=allowed), rate.counted_by_envoy, rate.global_counted_by_envoy
                )
    if settings is not None and base.native:
        native = frozenset(
            m.key
            for m in models
            if m.key in base.native
            and not (confirmed is not None and m.cluster in confirmed and not m.endpoint_set & confirmed[m.cluster])
        )
        if native != base.native:
            chosen = [m for m in models if m.key in native]
            route_config = {
                ROUTE_NAME: route_configuration(
                    settings,
                    chosen,
                    body_metadata=may_go_native(models, settings),
                    keys=keys,
                    rate_limited=envoy_rate_limited(models, settings),
                )
            }
    if endpoints is None and routes is None and route_config is base.by_type[ROUTE]:
        return base
    return Resources(
        by_type={
            **base.by_type,
            ENDPOINT: base_endpoints if endpoints is None else endpoints,
            MODEL_ROUTE: base_routes if routes is None else routes,
            ROUTE: route_config,
        },
        native=base.native,
    )


def natively_routed(config: route_pb2.RouteConfiguration) -> frozenset[str]:
    """Clusters a route table sends requests to without extproc (the native routes)."""
    return frozenset(
        route.route.cluster for host in config.virtual_hosts for route in host.routes if route.route.cluster
    )
