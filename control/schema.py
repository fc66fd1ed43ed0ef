"""The one typed definition of the `Model` manifest (wakegate.io/v1alpha1).

`wakegate up` validates files with it and the Kubernetes CRD's OpenAPI schema
is generated from it (control/crd.py), so a manifest means the same on one
machine and on a cluster. Field names are the manifest's camelCase names.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, create_model, field_validator, model_validator

from wakegate import contract

API_VERSION = "wakegate.io/v1alpha1"
GROUP = "wakegate.io"
VERSION = "v1alpha1"

#: DNS-1123 label: what Kubernetes accepts as a Model name, and what we accept locally.
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
#: Names clients may send as `model`: vLLM-style names such as `org/Model-7B:q4`.
SERVED_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,252}$"

ServedName = Annotated[str, Field(pattern=SERVED_NAME_PATTERN, max_length=253)]


class Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


class Strategy(StrEnum):
    DEFAULT = "default"
    SESSION_AFFINITY = "session-affinity"
    PREFIX = "prefix"
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"


class RoutingPath(StrEnum):
    """Who routes a warm request: wakegate's extproc (decided) or Envoy alone where it can (native)."""

    DECIDED = "decided"
    NATIVE = "native"


class ColdMode(StrEnum):
    HOLD = "hold"
    KEEPALIVE = "keepalive"
    REJECT = "reject"


class ScalingEngine(StrEnum):
    KEDA = "keda"
    BUILTIN = "builtin"


class Profile(StrEnum):
    BALANCED = "balanced"
    CACHE_FIRST = "cache-first"
    LOAD_FIRST = "load-first"
    STICKY_SESSIONS = "sticky-sessions"
    PRECISE = "precise"


DEFAULT_PROFILE = Profile.BALANCED
"""What a Model that names no routing (strategy `default`, no profile, no weights) is picked with;
chosen from tests/bench/bench_routing.py (docs/decisions.md, "The default picking")."""


class WeightsBase(Spec):
    """What every `routing.weights` model has; :func:`weights_model` adds one field per scorer."""

    #: Field name -> scorer name (as extproc knows it), in the table's order.
    scorer_names: ClassVar[dict[str, str]] = {}

    def scorers(self) -> dict[str, float]:
        """Scorer name (as extproc knows it) -> weight, the zero ones left out."""
        pairs = ((name, float(getattr(self, field))) for field, name in self.scorer_names.items())
        return {name: w for name, w in pairs if w > 0}


def weights_model(table: Iterable[contract.ScorerSpec]) -> type[WeightsBase]:
    """The `routing.weights` model of a scorer table: one weight in [0, 100] per scorer, default 0,
    named :attr:`~wakegate.contract.ScorerSpec.field`."""
    specs = list(table)
    fields: dict[str, Any] = {
        spec.field: (float, Field(0, ge=0, le=100, description=spec.description)) for spec in specs
    }
    if len(fields) < len(specs) or any(hasattr(WeightsBase, name) for name in fields):
        raise ValueError(f"scorer fields clash: {[spec.field for spec in specs]}")
    names = {spec.field: spec.name for spec in specs}
    return create_model(
        "Weights",
        __base__=WeightsBase,
        __module__=__name__,
        scorer_names=(ClassVar[dict[str, str]], names),
        **fields,
    )


if TYPE_CHECKING:
    Weights = WeightsBase
else:
    #: A Model's `routing.weights`: one field per scorer of `contract.SCORERS`.
    Weights = weights_model(contract.SCORERS)


class KVEvents(Spec):
    portOffset: int = Field(
        ge=1,
        le=1000,
        description="Each replica's engine publishes vLLM KV events over ZMQ on its HTTP port plus this "
        "(vLLM: --kv-events-config endpoint tcp://*:PORT+OFFSET).",
    )
    replayPortOffset: int = Field(
        0, ge=0, le=1000, description="Its replay socket is on its HTTP port plus this; 0: it has none."
    )


class Routing(Spec):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.profile) || !has(self.weights)",
                    "message": "routing takes a profile or weights, not both",
                },
                {
                    "rule": "(!has(self.profile) && !has(self.weights)) || !has(self.strategy) "
                    "|| self.strategy == 'default'",
                    "message": "routing.strategy cannot be combined with a profile or weights",
                },
                {
                    "rule": "has(self.kvEvents) || !((has(self.profile) && self.profile == 'precise') "
                    "|| (has(self.weights) && has(self.weights.precise) && self.weights.precise > 0))",
                    "message": "the precise scorer needs routing.kvEvents (where the engines publish KV events)",
                },
            ]
        }
    )
    strategy: Strategy = Field(
        Strategy.DEFAULT,
        description="How the gateway picks among ready endpoints; default: the balanced profile, "
        "round-robin: Envoy's round robin.",
    )
    profile: Profile | None = Field(
        None,
        description="Scored picking with a named set of weights (balanced is the recommended default); "
        "replaces strategy.",
    )
    weights: Weights | None = Field(None, description="Scored picking with these weights per scorer.")
    kvEvents: KVEvents | None = Field(
        None, description="Where the engines publish KV events, for the precise scorer (profile precise)."
    )
    path: RoutingPath = Field(
        RoutingPath.DECIDED,
        description="native: while the model is warm and needs nothing only wakegate's extproc can do "
        "(strategy round-robin or least-loaded, no adapters, no gateway-wide rate limit; on a cluster also no "
        "API keys on the gateway), Envoy routes "
        "its requests alone; otherwise, and while it is cold, they take the decided path (extproc). "
        "Status routingPath says which path it is on now.",
    )

    @property
    def uses_precise(self) -> bool:
        """Whether picking weighs the precise scorer."""
        if self.profile is not None:
            return self.profile == Profile.PRECISE
        return self.weights is not None and "precise" in self.weights.scorers()

    @model_validator(mode="after")
    def _one_form(self) -> Routing:
        if self.profile is not None and self.weights is not None:
            raise ValueError("routing takes a profile or weights, not both")
        if (self.profile is not None or self.weights is not None) and self.strategy != Strategy.DEFAULT:
            raise ValueError("routing.strategy cannot be combined with a profile or weights")
        if self.weights is not None and not self.weights.scorers():
            raise ValueError("routing.weights needs at least one weight above 0")
        if self.uses_precise and self.kvEvents is None:
            raise ValueError("the precise scorer needs routing.kvEvents (where the engines publish KV events)")
        return self


class Limits(Spec):
    requestsPerSecond: float = Field(
        0, ge=0, description="Per-model request rate admitted by each gateway; 0 means unlimited."
    )
    burst: float = Field(0, ge=0, description="Token-bucket burst; 0 means max(1, requestsPerSecond).")


class Predictive(Spec):
    enabled: bool = Field(
        False,
        description="Wake the model before the demand its history predicts (daily and weekly periodicity, "
        "recent inter-arrival times); off: it wakes only on demand.",
    )
    leadSeconds: int = Field(
        30, ge=1, le=3600, description="How long before the predicted demand the model is woken."
    )
    budgetSeconds: int = Field(
        600,
        ge=0,
        le=86400 * 7,
        description="Accelerator-seconds a period may spend warm on predictions before demand arrives; "
        "a prediction that would exceed it is skipped.",
    )
    periodSeconds: int = Field(
        86400,
        ge=10,
        le=86400 * 7,
        description="The daily period the history is folded on (weekly: seven of them), and the budget's window.",
    )


class Scaling(Spec):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "self.min <= self.max", "message": "scaling.min must not exceed scaling.max"},
                {
                    "rule": "!has(self.sleepAfter) || self.sleepAfter < self.idleTimeout",
                    "message": "scaling.sleepAfter must be below scaling.idleTimeout",
                },
            ]
        }
    )

    min: int = Field(1, ge=0, le=1000, description="Replicas kept running; 0 enables scale to zero.")
    max: int = Field(1, ge=1, le=1000, description="Upper bound on replicas.")
    idleTimeout: int = Field(
        300, ge=1, le=86400, description="Seconds without demand or in-flight requests before scaling to min."
    )
    activationTimeout: int = Field(
        180, ge=1, le=3600, description="Seconds a cold request waits for the model before 503."
    )
    targetInFlight: int = Field(
        8, ge=1, le=100000, description="Per-replica concurrency above which another replica is added."
    )
    scaleInWindow: int = Field(
        30,
        ge=0,
        le=3600,
        description="Seconds demand must need fewer replicas than run before scaling in to what it needs.",
    )
    engine: ScalingEngine = Field(
        ScalingEngine.KEDA,
        description="Who owns replicas on Kubernetes: KEDA (external-push) or the builtin engine.",
    )
    sleepAfter: int | None = Field(
        None,
        ge=1,
        le=86400,
        description="Seconds without demand or in-flight requests before a warm replica is put to sleep with "
        "the engine's own mechanism (vLLM sleep mode, Ollama's unload): the process stays, the accelerator is "
        "freed, and the next request wakes it faster than a start from zero. Below idleTimeout, which still "
        "takes the model to min (zero). Unset: no asleep tier. Engines without such a mechanism skip it.",
    )
    sleepLevel: Literal[1, 2] = Field(
        1,
        description="vLLM's sleep level: 1 keeps the weights in host memory (fastest wake; needs that much "
        "host memory free), 2 discards them and reloads them from disk on wake. Other engines ignore it.",
    )
    predictive: Predictive = Field(
        default_factory=Predictive,
        description="Wake the model shortly before the demand its own history predicts.",
    )

    @model_validator(mode="after")
    def _min_le_max(self) -> Scaling:
        if self.min > self.max:
            raise ValueError(f"scaling.min ({self.min}) must not exceed scaling.max ({self.max})")
        if self.sleepAfter is not None and self.sleepAfter >= self.idleTimeout:
            raise ValueError(
                f"scaling.sleepAfter ({self.sleepAfter}) must be below scaling.idleTimeout ({self.idleTimeout})"
            )
        return self


class Endpoint(Spec):
    maxQueue: int = Field(100, ge=0, le=100000, description="Cold requests held per model per gateway.")
    coldMode: ColdMode = Field(ColdMode.HOLD, description="What a request to a model with no ready replica gets.")


class Band(StrEnum):
    """Priority bands of flow control, highest first: a higher band is always dispatched first, and
    the lowest is shed first."""

    CRITICAL = "critical"
    STANDARD = "standard"
    SHEDDABLE = "sheddable"


class Saturation(Spec):
    maxWaiting: int | None = Field(
        None,
        ge=0,
        le=100000,
        description="A replica is saturated while its engine has this many requests waiting (0: not used): the "
        "gateway leaves fewer waiting there; "
        "default: the engine's (5 for vLLM and the sim, 1 for llama.cpp, unused for engines without metrics).",
    )
    maxKvCacheUsage: float | None = Field(
        None,
        ge=0,
        le=1,
        description="... or KV-cache usage at or above this fraction (0: not used); default: the engine's (0.9).",
    )
    maxInFlight: int = Field(
        0,
        ge=0,
        le=100000,
        description="... or this gateway has this many requests in flight on it (0: not used; the default "
        "for engines that report no load is 4).",
    )


class FlowControl(Spec):
    enabled: bool = Field(
        False,
        description="Hold requests in the gateway while every replica is saturated, in one queue per (tenant, "
        "band): strict by band, weighted fair among tenants; the lowest band is shed first. Keeps the model on "
        "the decided path.",
    )
    band: Band = Field(Band.STANDARD, description="The band of requests whose API key names none.")
    maxQueue: int = Field(1000, ge=1, le=100000, description="Requests held per model per gateway while saturated.")
    queueTimeout: int = Field(
        30, ge=1, le=3600, description="Seconds a request waits for a saturated model before a 503."
    )
    saturation: Saturation = Field(default_factory=Saturation)


class Gpu(Spec):
    shared: str | None = Field(
        None,
        pattern=NAME_PATTERN,
        max_length=63,
        description="GPU group name: models in one group never run at the same time.",
    )
    priority: int = Field(0, ge=-1000, le=1000, description="Higher priority may take over the group.")
    minRunSeconds: int = Field(
        30,
        ge=0,
        le=86400,
        description="An active group member runs at least this long before it can be swapped out.",
    )
    swapCooldownSeconds: int = Field(
        60, ge=0, le=86400, description="A member swapped out may not swap back in for this long."
    )
    demandWindowSeconds: int = Field(
        5, ge=0, le=3600, description="Demand must last this long before it causes a swap."
    )
    queueThreshold: int = Field(
        1,
        ge=1,
        le=100000,
        description="Requests (held or in flight, over all gateways) needed before a swap; 1 = any demand.",
    )


class GpuResources(Spec):
    count: int = Field(0, ge=0, le=64, description="Accelerators per replica.")
    vendor: Literal["nvidia", "amd"] | None = Field(None, description="Accelerator vendor.")
    minVramMb: int = Field(0, ge=0, description="Minimum free VRAM per accelerator, MiB.")
    arch: list[Annotated[str, Field(pattern=r"^[a-z0-9]+$", max_length=32)]] = Field(
        default_factory=list, description="Accepted architectures, e.g. sm90, gfx1100; empty = any."
    )


class Resources(Spec):
    gpu: GpuResources = Field(default_factory=GpuResources)
    cpu: str | None = Field(None, pattern=r"^[0-9]+(\.[0-9]+)?m?$", description="CPU request, e.g. 4 or 500m.")
    memory: str | None = Field(
        None, pattern=r"^[0-9]+(\.[0-9]+)?([EPTGMK]i?)?$", description="Memory request, e.g. 32Gi."
    )


class RuntimeRef(Spec):
    name: str = Field(pattern=NAME_PATTERN, max_length=253, description="InferenceRuntime to render from.")


#: A Secret's name (a DNS subdomain) and a key in it.
SECRET_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"  # noqa: S105 - a name pattern, no secret
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
#: A Kubernetes memory quantity, as `resources.memory` takes it.
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?([EPTGMK]i?)?$"


class SecretKeyRef(Spec):
    name: str = Field(pattern=SECRET_NAME_PATTERN, max_length=253, description="A Secret in the Model's namespace.")
    key: str = Field(pattern=r"^[-._a-zA-Z0-9]+$", max_length=253, description="The key in it whose value is used.")
    optional: bool = Field(False, description="Start without the variable when the Secret or key is missing.")


class SecretEnvVar(Spec):
    name: str = Field(pattern=ENV_NAME_PATTERN, max_length=253, description="Environment variable of the engine.")
    secretKeyRef: SecretKeyRef = Field(
        description="Where its value comes from; the pod spec names the Secret, never the value."
    )


class SecretRef(Spec):
    name: str = Field(
        pattern=NAME_PATTERN,
        max_length=253,
        description="A Secret in the same namespace holding a Docker config (`.dockerconfigjson`, as "
        "imagePullSecrets do) with the registry's credentials.",
    )


class Toleration(Spec):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    tolerationSeconds: int | None = None


#: The CRD's coarse check of `spec.source` (scheme and no spaces); `ModelSpec` parses the rest
#: with the delivery library's `parse_source`, so a manifest and a cluster object agree.
SOURCE_PATTERN = r"^(file|hf|pvc|oci)://[^\s]+$"


class CacheStrategy(StrEnum):
    #: The engine reads the source itself (file:// and pvc:// in place; on a cluster an oci://
    #: source is an image volume). `wakegate up` still pulls oci:// and hf:// into its cache.
    NONE = "none"
    #: The node's cache: a pod starts once this node's cache holds the weights (pulled first).
    NODE = "node"
    #: A ModelCache keeps the weights warm on the nodes where the Model may run.
    PREWARM = "prewarm"


class CacheSettings(Spec):
    strategy: CacheStrategy = Field(CacheStrategy.NONE, description="How the weights reach the engine.")
    flash: bool = Field(
        False,
        description="`wakegate up` only: stage the cached weights into fast storage (tmpfs, `--flash-dir`) "
        "before the engine starts, checking every block on the way (as `wakegate flash-load` does). Ignored on "
        "a cluster: the pod reads the node-cache entry or the source in place.",
    )


def _checked_source(value: str) -> str:
    """`value` when the delivery library can parse it as a source; its message as a ValueError if not."""
    from wakegate.control.delivery.errors import SourceError
    from wakegate.control.delivery.sources import parse_source

    try:
        parse_source(value)
    except SourceError as exc:
        raise ValueError(str(exc)) from None
    return value


def backend_enum(schema: dict[str, Any]) -> None:
    from wakegate.control.backends import BACKENDS

    schema["enum"] = sorted(BACKENDS)


class AdapterSettings(Spec):
    maxAdapters: int = Field(
        4,
        ge=1,
        le=256,
        description="LoRA adapters one replica holds at once; the least recently used is unloaded to make room "
        "(llama.cpp loads every adapter of the base at start, so there it caps how many the base may have).",
    )
    idleTimeout: int | None = Field(
        None,
        ge=1,
        le=86400,
        description="Seconds an adapter loaded at run time stays unused on a replica before it is unloaded; "
        "default: the base's scaling.idleTimeout.",
    )
    placement: Literal["affinity", "random"] = Field(
        "affinity",
        description="Where a request for an adapter goes: affinity (a replica that holds it, else one loads it) "
        "or random (any replica, loading it there: a baseline for comparison).",
    )


class ModelSpec(Spec):
    backend: str = Field(
        description="Backend plugin that serves the model (see `wakegate up --list-backends`).",
        json_schema_extra=backend_enum,
    )
    servedName: ServedName | None = Field(
        None,
        description="Name the backend serves; defaults to metadata.name. Request bodies are rewritten to it.",
    )
    aliases: list[ServedName] = Field(default_factory=list, description="Other names clients may ask for.")
    loraAdapters: list[ServedName] = Field(
        default_factory=list,
        description="LoRA adapter names the backend serves on top of this model by itself (names only; "
        "a LoRAAdapter object also has its weights fetched and loaded).",
    )
    adapters: AdapterSettings = Field(
        default_factory=AdapterSettings, description="How the replicas hold the LoRAAdapters of this model."
    )
    command: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list,
        description="The engine's executable (and leading words), replacing the backend's own; its flags follow.",
    )
    args: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list, description="Appended to the backend's command."
    )
    env: dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")], str] = Field(
        default_factory=dict, description="Extra environment for the backend process."
    )
    routing: Routing = Field(default_factory=Routing)
    limits: Limits = Field(default_factory=Limits)
    scaling: Scaling = Field(default_factory=Scaling)
    endpoint: Endpoint = Field(default_factory=Endpoint)
    flowControl: FlowControl = Field(default_factory=FlowControl)
    gpu: Gpu = Field(default_factory=Gpu)
    # Kubernetes placement; ignored by `wakegate up`.
    runtimeRef: RuntimeRef | None = None
    source: str | None = Field(
        None,
        pattern=SOURCE_PATTERN,
        description="Weights: file:// (a path on the machine; relative to the manifest's folder in "
        "`wakegate up`), hf://ORG/REPO[@REV][/PATH], pvc://CLAIM[/PATH], or oci://REGISTRY/REPO:TAG "
        "or @sha256:…",
    )
    cache: CacheSettings = Field(default_factory=CacheSettings)
    resources: Resources = Field(default_factory=Resources)
    tolerations: list[Toleration] = Field(
        default_factory=list,
        description="Added after the runtime's; a GPU pod tolerates its vendor's taint (e.g. nvidia.com/gpu) "
        "without asking.",
    )
    nodeSelector: dict[str, str] = Field(default_factory=dict)
    secretEnv: list[SecretEnvVar] = Field(
        default_factory=list,
        description="Environment from Secrets (e.g. HF_TOKEN), read by the kubelet; the value never appears "
        "in the pod spec, args or status.",
    )
    imagePullSecrets: list[SecretRef] = Field(
        default_factory=list, description="Secrets (in the Model's namespace) for pulling the runtime's image."
    )

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        from wakegate.control.backends import BACKENDS

        if value not in BACKENDS:
            raise ValueError(f"unknown backend {value!r}; known: {', '.join(sorted(BACKENDS))}")
        return value

    @field_validator("source")
    @classmethod
    def _parsed_source(cls, value: str | None) -> str | None:
        return None if value is None else _checked_source(value)

    @model_validator(mode="after")
    def _backend_can_serve(self) -> ModelSpec:
        from wakegate.control.backends import BACKENDS

        backend = BACKENDS[self.backend]
        if not backend.program and not self.command:
            raise ValueError(f"backend {self.backend} has no standard command: set spec.command to the engine's")
        if backend.needs_file and self.source is None:
            raise ValueError(
                f"backend {self.backend} loads one GGUF file: set spec.source (file://, oci:// or hf://…/FILE.gguf)"
            )
        secret_names = [item.name for item in self.secretEnv]
        repeated = {name for name in secret_names if secret_names.count(name) > 1}
        twice = sorted(repeated | (set(secret_names) & set(self.env)))
        if twice:
            raise ValueError(
                f"environment variable set twice (env and secretEnv, or secretEnv twice): {', '.join(twice)}"
            )
        return self


class Metadata(Spec):
    model_config = ConfigDict(extra="ignore", frozen=True)
    name: str = Field(pattern=NAME_PATTERN, max_length=60)
    namespace: str | None = Field(None, pattern=NAME_PATTERN, max_length=63)
    labels: dict[str, str] = Field(default_factory=dict)


class LoRAAdapterSpec(Spec):
    baseModel: str = Field(pattern=NAME_PATTERN, max_length=60, description="The Model this adapter applies to.")
    source: str = Field(
        pattern=SOURCE_PATTERN,
        max_length=2048,
        description="The adapter's weights (a LoRA GGUF for llama.cpp, a PEFT folder for vLLM): file://, "
        "hf://, pvc:// or oci://, as a Model's source.",
    )
    servedName: ServedName | None = Field(
        None, description="The name the engine knows the adapter by; defaults to metadata.name."
    )
    aliases: list[ServedName] = Field(default_factory=list, description="Other names clients may ask for.")
    scale: float = Field(1.0, ge=-100, le=100, description="How strongly the adapter is applied (llama.cpp).")

    @field_validator("source")
    @classmethod
    def _parsed_source(cls, value: str) -> str:
        return _checked_source(value)


class LoRAAdapter(Spec):
    apiVersion: Literal["wakegate.io/v1alpha1"] = "wakegate.io/v1alpha1"
    kind: Literal["LoRAAdapter"] = "LoRAAdapter"
    metadata: Metadata
    spec: LoRAAdapterSpec

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def served_name(self) -> str:
        return self.spec.servedName or self.metadata.name

    @property
    def client_names(self) -> list[str]:
        """Every name a client may send for the adapter, its own name first, without repeats."""
        return list(dict.fromkeys([self.metadata.name, self.served_name, *self.spec.aliases]))


class Model(Spec):
    apiVersion: Literal["wakegate.io/v1alpha1"]
    kind: Literal["Model"]
    metadata: Metadata
    spec: ModelSpec
    #: The LoRAAdapter objects naming this Model as their base, in manifest order (set by
    #: :func:`parse_manifest`; on a cluster by whoever reads both kinds). Not part of the manifest.
    _adapters: tuple[LoRAAdapter, ...] = PrivateAttr(default=())

    @property
    def adapters(self) -> tuple[LoRAAdapter, ...]:
        return self._adapters

    def with_adapters(self, adapters: Iterable[LoRAAdapter]) -> Model:
        """A copy of this Model that serves `adapters` (each names it as its base)."""
        copy = self.model_copy()
        copy._adapters = tuple(adapters)
        return copy

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def key(self) -> str:
        """Stable identity: `name` locally, `namespace/name` on a cluster."""
        ns = self.metadata.namespace
        return f"{ns}/{self.metadata.name}" if ns else self.metadata.name

    @property
    def served_name(self) -> str:
        return self.spec.servedName or self.metadata.name

    @property
    def client_names(self) -> list[str]:
        """Every name a client may send, the model's own name first, without repeats."""
        names = [self.metadata.name, self.served_name, *self.spec.aliases]
        return list(dict.fromkeys(names))
