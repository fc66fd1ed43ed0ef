"""The federation's kinds (wakegate.io/v1alpha1): `Cluster`, `FederatedModel` and `GlobalProxy`.

A `Cluster` says how to reach one member cluster's gateway (and, optionally, its API server);
a `FederatedModel` is a Model template plus where to place it; a `GlobalProxy` is the global
gateway's settings. The CRDs are generated from these classes (control/crd.py), and
`wakegate federation gateway -f FILE` reads the same documents from a file, so they mean the
same on one machine and on a cluster. Pure: no I/O (docs/federation.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from wakegate.control.manifests import ManifestError, _docs, _validated
from wakegate.control.schema import NAME_PATTERN, SECRET_NAME_PATTERN, Metadata, ModelSpec, Spec

#: An http(s) URL of a member gateway: scheme, host (name, IPv4 or [IPv6]) and port, no path.
GATEWAY_URL_PATTERN = r"^https?://([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]):[0-9]{1,5}$"
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
#: A DNS name a member gateway's certificate is issued to (SNI and the SAN checked).
SERVER_NAME_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?)*$"


class ClusterSecretRef(Spec):
    """A key of a Secret; Clusters are cluster-scoped, so the Secret's namespace is named."""

    namespace: str = Field(pattern=NAME_PATTERN, max_length=63, description="The Secret's namespace.")
    name: str = Field(pattern=SECRET_NAME_PATTERN, max_length=253, description="The Secret.")
    key: str = Field(pattern=r"^[-._a-zA-Z0-9]+$", max_length=253, description="The key whose value is used.")


class MemberGateway(Spec):
    url: str = Field(
        pattern=GATEWAY_URL_PATTERN, max_length=300, description="The member gateway's listener, http(s)://HOST:PORT."
    )
    token: ClusterSecretRef | None = Field(
        None, description="A Secret key holding the bearer token the global gateway presents; never shown."
    )
    tokenFile: str | None = Field(
        None, max_length=4096, description="A file holding that token (`wakegate federation` on one machine)."
    )
    ca: ClusterSecretRef | None = Field(
        None, description="A Secret key with the CA bundle the gateway's TLS chains to."
    )
    clientCert: ClusterSecretRef | None = Field(
        None,
        description="A `kubernetes.io/tls` Secret's key for a client certificate (mTLS); the private key is the "
        "Secret's `tls.key`.",
    )
    caFile: str | None = Field(
        None, max_length=4096, description="A file with that CA bundle (one machine; relative to the file)."
    )
    clientCertFile: str | None = Field(
        None, max_length=4096, description="A file with the client certificate chain (one machine; mTLS)."
    )
    clientKeyFile: str | None = Field(
        None, max_length=4096, description="A file with the client certificate's private key (with clientCertFile)."
    )
    serverName: str | None = Field(
        None,
        pattern=SERVER_NAME_PATTERN,
        max_length=253,
        description="The DNS name the gateway's certificate is issued to: sent as SNI and checked against its "
        "SANs. Default: the URL's host, checked as an IP SAN (no SNI).",
    )

    @model_validator(mode="after")
    def _one_token(self) -> MemberGateway:
        if self.token is not None and self.tokenFile is not None:
            raise ValueError("name the token once: token (a Secret) or tokenFile")
        if self.ca is not None and self.caFile is not None:
            raise ValueError("name the CA once: ca (a Secret) or caFile")
        if self.clientCert is not None and (self.clientCertFile is not None or self.clientKeyFile is not None):
            raise ValueError("name the client certificate once: clientCert (a Secret) or clientCertFile")
        if (self.clientCertFile is None) != (self.clientKeyFile is None):
            raise ValueError("clientCertFile and clientKeyFile go together")
        tls = [
            name
            for name in ("ca", "caFile", "clientCert", "clientCertFile", "serverName")
            if getattr(self, name) is not None
        ]
        if self.url.startswith("https://"):
            if self.ca is None and self.caFile is None:
                raise ValueError("an https:// gateway needs the CA its certificate chains to: ca or caFile")
        elif tls:
            raise ValueError(f"{', '.join(tls)}: only for an https:// gateway url")
        return self


class ClusterSpec(Spec):
    gateway: MemberGateway = Field(description="How the global gateway and the prober reach this cluster's gateway.")
    region: str | None = Field(None, pattern=LABEL_VALUE_PATTERN, max_length=63, description="Where it runs.")
    weight: int = Field(
        100, ge=1, le=1000, description="Share of the traffic this cluster takes among equally good members."
    )
    kubeconfig: ClusterSecretRef | None = Field(
        None, description="A Secret key with a kubeconfig: the federation controller writes Models there."
    )
    gpus: int = Field(
        0, ge=0, le=100000, description="Accelerators this cluster offers federated models (0: not counted)."
    )


class PlacementMode(StrEnum):
    SPREAD = "spread"
    FILL_FIRST = "fill-first"


class Placement(Spec):
    clusters: list[Annotated[str, Field(pattern=NAME_PATTERN, max_length=253)]] = Field(
        default_factory=list, max_length=64, description="Clusters by name."
    )
    clusterSelector: dict[str, str] = Field(
        default_factory=dict, description="Clusters whose labels include all of these (with `clusters`, either)."
    )
    min: int = Field(0, ge=0, le=1000, description="Replicas each placed cluster keeps (its Model's scaling.min).")
    max: int = Field(1, ge=1, le=1000, description="Replicas each placed cluster may run (its scaling.max).")
    mode: PlacementMode = Field(
        PlacementMode.SPREAD,
        description="spread: traffic over every warm member by weight; fill-first: the first warm member in "
        "`failover` order takes it all.",
    )
    failover: list[Annotated[str, Field(pattern=NAME_PATTERN, max_length=253)]] = Field(
        default_factory=list,
        max_length=64,
        description="Preference order of clusters: the first is woken when the model is cold everywhere.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> Placement:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) exceeds max ({self.max})")
        if not self.clusters and not self.clusterSelector:
            raise ValueError("name clusters or a clusterSelector")
        return self


class FederatedModelSpec(Spec):
    template: ModelSpec = Field(description="The spec of the Model written into every placed cluster.")
    placement: Placement = Field(description="Which clusters serve the model, and how.")


class RoutingPolicy(StrEnum):
    #: warm members first, then the fewest held and in-flight requests, then the lowest latency.
    WARM_FIRST = "warm-first"


class Listener(Spec):
    address: str = Field("0.0.0.0", max_length=255, description="Address the global gateway listens on.")
    port: int = Field(8080, ge=1, le=65535)


class ProxyAuth(Spec):
    apiKeys: ClusterSecretRef | None = Field(
        None, description="A Secret key with the API keys clients present (the format of `wakegate extproc`)."
    )
    apiKeysFile: str | None = Field(None, max_length=4096, description="The same as a file (one machine).")


class HealthCheck(Spec):
    intervalSeconds: float = Field(1.0, ge=0.1, le=300, description="How often each member gateway is probed.")
    timeoutSeconds: float = Field(1.0, ge=0.05, le=60, description="A probe slower than this fails.")
    unhealthyThreshold: int = Field(1, ge=1, le=100, description="Failed probes in a row that take a member out.")

    @model_validator(mode="after")
    def _timeout_within_interval(self) -> HealthCheck:
        if self.timeoutSeconds > self.intervalSeconds:
            raise ValueError("timeoutSeconds exceeds intervalSeconds (a member would be probed twice at once)")
        return self


class RetryWhen(StrEnum):
    #: Only requests no member can have seen: no connection, a refused stream, a reset before
    #: the request was written.
    UNSENT = "unsent"
    #: Also a member that reset before answering (it may have started on the request, which then
    #: runs twice), but never once a byte of the answer reached the client.
    BEFORE_RESPONSE = "before-response"


class Retries(Spec):
    attempts: int = Field(
        2, ge=0, le=5, description="Other members a request is tried on when the first cannot take it (`when`)."
    )
    when: RetryWhen = Field(
        RetryWhen.BEFORE_RESPONSE,
        description="unsent: only requests no member saw; before-response: also a member that reset before "
        "answering. Never once a byte reached the client. In both, a member's own reply marked "
        "x-wakegate-unserved (no model server saw the request) is retried too.",
    )


class GlobalProxySpec(Spec):
    listeners: list[Listener] = Field(default_factory=lambda: [Listener()], min_length=1, max_length=1)
    auth: ProxyAuth = Field(default_factory=ProxyAuth)
    routing: RoutingPolicy = Field(RoutingPolicy.WARM_FIRST, description="How a member is picked.")
    retries: Retries = Field(default_factory=Retries)
    healthCheck: HealthCheck = Field(default_factory=HealthCheck)


class _Object(Spec):
    """What every federation object has besides its kind and spec."""

    apiVersion: Literal["wakegate.io/v1alpha1"] = "wakegate.io/v1alpha1"
    metadata: Metadata

    @property
    def name(self) -> str:
        return self.metadata.name


class Cluster(_Object):
    kind: Literal["Cluster"] = "Cluster"
    spec: ClusterSpec


class FederatedModel(_Object):
    kind: Literal["FederatedModel"] = "FederatedModel"
    spec: FederatedModelSpec

    @field_validator("spec")
    @classmethod
    def _template_names(cls, spec: FederatedModelSpec) -> FederatedModelSpec:
        if spec.template.loraAdapters:
            raise ValueError("template.loraAdapters: a federated model carries no adapters yet")
        return spec


class GlobalProxy(_Object):
    kind: Literal["GlobalProxy"] = "GlobalProxy"
    spec: GlobalProxySpec = Field(default_factory=GlobalProxySpec)


@dataclass(frozen=True)
class Federation:
    """The documents of one federation file: members, federated models and at most one proxy."""

    clusters: list[Cluster]
    models: list[FederatedModel]
    proxy: GlobalProxy


_KINDS: dict[str, type[Cluster] | type[FederatedModel] | type[GlobalProxy]] = {
    "Cluster": Cluster,
    "FederatedModel": FederatedModel,
    "GlobalProxy": GlobalProxy,
}


def parse_federation(text: str, source: str = "<input>") -> Federation:
    """Parse Cluster, FederatedModel and GlobalProxy documents; raise ManifestError naming the
    document and field. Names are unique per kind, and every cluster a placement names exists."""
    clusters: dict[str, Cluster] = {}
    models: dict[str, FederatedModel] = {}
    proxies: list[GlobalProxy] = []
    for doc in _docs(text):
        where = f"{source}: document {doc.index}"
        kind = doc.body.get("kind") if isinstance(doc.body, dict) else None
        typed = _KINDS.get(kind) if isinstance(kind, str) else None
        if typed is None:
            raise ManifestError(f"{where}: kind must be one of {', '.join(_KINDS)}, not {kind!r}")
        parsed = _validated(typed, doc.body, f"{where} ({kind})")
        if isinstance(parsed, GlobalProxy):
            proxies.append(parsed)
            continue
        seen: dict[str, Cluster] | dict[str, FederatedModel] = clusters if isinstance(parsed, Cluster) else models
        if parsed.name in seen:
            raise ManifestError(f"{where}: a {kind} named {parsed.name!r} is already defined")
        if isinstance(parsed, Cluster):
            clusters[parsed.name] = parsed
        else:
            models[parsed.name] = parsed
    if len(proxies) > 1:
        raise ManifestError(f"{source}: at most one GlobalProxy, found {len(proxies)}")
    if not clusters:
        raise ManifestError(f"{source}: no Cluster documents found")
    for model in models.values():
        placement = model.spec.placement
        for name in [*placement.clusters, *placement.failover]:
            if name not in clusters:
                raise ManifestError(f"{source}: FederatedModel {model.name!r}: no Cluster {name!r}")
    proxy = proxies[0] if proxies else GlobalProxy(metadata=Metadata(name="global"))
    return Federation(list(clusters.values()), list(models.values()), proxy)
