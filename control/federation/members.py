"""What the federation knows of its members, and what it decides from that (pure: no I/O).

Each member gateway is probed on its `GET /wakegate/status` (wakegate.contract.STATUS_PATH):
per model, its names, ready endpoints and held and in-flight requests. From the newest
probe of every member this module decides:

- which members are placed for a FederatedModel (`placed`: by name or label selector, in
  failover order, then by name);
- the global gateway's routes (`global_routes`): one `RoutedModel` per FederatedModel whose
  endpoints are the member gateways that are reachable *and* report the model ready, with
  their held + in-flight count as the endpoint's load (extproc's least-loaded pick reads it).
  A member that does not report the model never becomes its endpoint;
- which single member is asked to wake a model that is cold everywhere (`wake_target`);
- the member Models the controller applies (`member_model`) and the statuses it writes.

Decisions take `now` as a parameter and return plain data, so tests are exact.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

from wakegate.control.federation_schema import Cluster, FederatedModel, PlacementMode
from wakegate.control.feeder.routed import RoutedModel, UpstreamTls
from wakegate.control.schema import API_VERSION

#: Label on every Model the federation controller writes: the FederatedModel it came from.
FEDERATED_LABEL = "wakegate.io/federated-model"
#: The federation controller's field manager on member clusters (server-side apply).
FIELD_MANAGER = "wakegate-federation"


@dataclass(frozen=True)
class ModelReport:
    """One model as a member gateway reports it."""

    model: str
    names: tuple[str, ...]
    ready_endpoints: int
    queued: int
    in_flight: int

    @property
    def load(self) -> int:
        return self.queued + self.in_flight


@dataclass(frozen=True)
class MemberReport:
    """One probe's answer: the member's models by every name they answer to."""

    synced: bool
    models: Mapping[str, ModelReport]

    def find(self, names: Iterable[str]) -> ModelReport | None:
        """The member's model answering to the first of `names` it knows."""
        for name in names:
            found = self.models.get(name)
            if found is not None:
                return found
        return None


#: A member's status answer larger than this is refused (a member is trusted, but bounded).
MAX_STATUS_BYTES = 4 << 20


def parse_status(body: bytes) -> MemberReport:
    """A member gateway's status body; ValueError with a short reason when it is not one."""
    if len(body) > MAX_STATUS_BYTES:
        raise ValueError(f"status body over {MAX_STATUS_BYTES} bytes")
    try:
        raw = json.loads(body)
        by_name: dict[str, ModelReport] = {}
        for entry in raw["models"]:
            names = tuple(str(n) for n in entry.get("names") or [entry["model"]])
            report = ModelReport(
                model=str(entry["model"]),
                names=names,
                ready_endpoints=int(entry["ready_endpoints"]),
                queued=int(entry.get("queued", 0)),
                in_flight=int(entry.get("in_flight", 0)),
            )
            for name in names:
                by_name.setdefault(name, report)
        return MemberReport(bool(raw.get("synced", True)), by_name)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"not a wakegate status answer ({type(exc).__name__})") from None


@dataclass(frozen=True)
class MemberHealth:
    """What the prober last learnt of one member gateway."""

    reachable: bool = False
    #: Seconds the last successful probe took.
    latency_s: float | None = None
    #: `now` of the last successful probe; None: never reached.
    last_seen: float | None = None
    #: Failed probes in a row.
    failures: int = 0
    report: MemberReport | None = None
    #: Why it is unreachable (a short word and detail), empty while reachable.
    reason: str = ""

    def observed(self, report: MemberReport, latency_s: float, now: float) -> MemberHealth:
        return MemberHealth(True, latency_s, now, 0, report, "")

    def failed(self, reason: str, threshold: int) -> MemberHealth:
        """A failed probe: the member leaves the routes once `threshold` failed in a row."""
        failures = self.failures + 1
        reachable = self.reachable and failures < threshold
        return replace(self, reachable=reachable, failures=failures, reason=reason)


@dataclass(frozen=True)
class Member:
    """One Cluster as the global gateway routes to it: its gateway's address and its facts."""

    name: str
    host: str
    port: int
    url: str
    labels: Mapping[str, str] = field(default_factory=dict)
    weight: int = 100
    gpus: int = 0
    #: An https:// gateway: reached over TLS only (verified against its Cluster's CA).
    tls: bool = False
    #: The DNS name its certificate carries (`gateway.serverName`); None: its IP is checked.
    server_name: str | None = None

    @property
    def endpoint(self) -> tuple[str, int]:
        return (self.host, self.port)


def member_of(cluster: Cluster) -> Member:
    """A Cluster's gateway as an (ip, port) upstream. The global Envoy takes IP literals as EDS
    endpoints; a host name is refused here (resolve it into the Cluster's URL)."""
    parts = urlsplit(cluster.spec.gateway.url)
    host = parts.hostname or ""
    if parts.port is None:
        raise ValueError(f"Cluster {cluster.name!r}: gateway.url names no port")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"Cluster {cluster.name!r}: gateway.url host {host!r} is not an IP address") from None
    return Member(
        cluster.name,
        host,
        parts.port,
        cluster.spec.gateway.url,
        dict(cluster.metadata.labels),
        cluster.spec.weight,
        cluster.spec.gpus,
        parts.scheme == "https",
        cluster.spec.gateway.serverName,
    )


def placed(model: FederatedModel, members: Iterable[Member]) -> list[Member]:
    """The members a FederatedModel is placed in: named, or matching its selector; in failover
    order first, then by name."""
    placement = model.spec.placement
    selector = placement.clusterSelector
    chosen = [
        m
        for m in members
        if m.name in placement.clusters or (selector and all(m.labels.get(k) == v for k, v in selector.items()))
    ]
    order = {name: i for i, name in enumerate(placement.failover)}
    return sorted(chosen, key=lambda m: (order.get(m.name, len(order)), m.name))


def warm_members(
    model: FederatedModel, members: Iterable[Member], health: Mapping[str, MemberHealth]
) -> list[tuple[Member, ModelReport]]:
    """Placed members that are reachable and report the model with a ready endpoint, in placement order."""
    names = client_names(model)
    warm = []
    for member in placed(model, members):
        state = health.get(member.name)
        if state is None or not state.reachable or state.report is None:
            continue
        found = state.report.find(names)
        if found is not None and found.ready_endpoints > 0:
            warm.append((member, found))
    return warm


def client_names(model: FederatedModel) -> list[str]:
    """Every name a client may send for the federated model, its own name first."""
    template = model.spec.template
    return list(dict.fromkeys([model.name, template.servedName or model.name, *template.aliases]))


def model_key(model: FederatedModel) -> str:
    ns = model.metadata.namespace
    return f"{ns}/{model.name}" if ns else model.name


def global_routes(
    models: Iterable[FederatedModel],
    members: Iterable[Member],
    health: Mapping[str, MemberHealth],
    retries: int = 0,
    tokens: Mapping[str, str] | None = None,
    tls: Mapping[str, UpstreamTls] | None = None,
) -> list[RoutedModel]:
    """The global gateway's routes: per FederatedModel, the warm members as endpoints (with up to
    `retries` others named after each pick, where Envoy retries a request no member saw); a
    member with a token in `tokens` (by cluster) gets it as the requests' bearer token. An
    https:// member is reached with its `tls` (by cluster), and without one it is no endpoint:
    it is never spoken to in plain text."""
    tokens = tokens or {}
    tls = tls or {}
    members = list(members)
    routes = []
    for model in models:
        warm = [(m, r) for m, r in warm_members(model, members, health) if not m.tls or m.name in tls]
        if model.spec.placement.mode is PlacementMode.FILL_FIRST:
            warm = warm[:1]
        template = model.spec.template
        routes.append(
            RoutedModel(
                key=model_key(model),
                names=tuple(client_names(model)),
                # Members know the model by every one of its names; the body keeps the one the member's
                # own route rewrites, so what reaches the engine is what a member-local client would send.
                served_name=template.servedName or model.name,
                strategy="least-loaded",
                cold_mode="hold",
                max_queue=template.endpoint.maxQueue,
                activation_timeout_s=float(template.scaling.activationTimeout),
                endpoints=tuple(sorted(m.endpoint for m, _ in warm)),
                loads=tuple(sorted((m.host, m.port, report.load) for m, report in warm)),
                fallback_endpoints=retries,
                endpoint_weights=tuple(sorted((m.host, m.port, m.weight) for m, _ in warm)),
                endpoint_tls=tuple(sorted(((m.host, m.port, tls[m.name]) for m, _ in warm if m.tls), key=_address)),
                endpoint_authorization=tuple(
                    sorted((m.host, m.port, f"Bearer {tokens[m.name]}") for m, _ in warm if tokens.get(m.name))
                ),
            )
        )
    return routes


def _address(entry: tuple[str, int, UpstreamTls]) -> tuple[str, int]:
    return entry[0], entry[1]


def wake_target(
    model: FederatedModel,
    members: Iterable[Member],
    health: Mapping[str, MemberHealth],
    tried: Iterable[str] = (),
) -> Member | None:
    """The one member asked to wake a model cold everywhere: among the placed members that are
    reachable and serve the model (report it, ready or not) and were not tried for this activation,
    the first in failover order; without a failover order, the one with the most accelerators,
    then the lowest latency. None: no member can."""
    names = client_names(model)
    skip = set(tried)
    candidates = []
    for member in placed(model, members):
        state = health.get(member.name)
        if member.name in skip or state is None or not state.reachable or state.report is None:
            continue
        if state.report.find(names) is not None:
            candidates.append((member, state))
    if not candidates:
        return None
    if model.spec.placement.failover:
        return candidates[0][0]
    return min(candidates, key=lambda c: (-c[0].gpus, c[1].latency_s or 0.0, c[0].name))[0]


def member_model(model: FederatedModel, namespace: str) -> dict[str, Any]:
    """The Model the controller applies in a placed member (server-side apply, FIELD_MANAGER):
    the template, with the placement's per-cluster bounds as its scaling."""
    spec = model.spec.template.model_dump(mode="json", exclude_defaults=True)
    placement = model.spec.placement
    spec["scaling"] = {**spec.get("scaling", {}), "min": placement.min, "max": placement.max}
    return {
        "apiVersion": API_VERSION,
        "kind": "Model",
        "metadata": {"name": model.name, "namespace": namespace, "labels": {FEDERATED_LABEL: model.name}},
        "spec": spec,
    }


#: Extended resources counted as accelerators in a member's capacity summary.
ACCELERATOR_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu")


def gpu_summary(nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """A member cluster's accelerators: allocatable on its nodes, and requested by its pods that
    hold them (not finished), from the API's Node and Pod objects."""
    total = 0
    for node in nodes:
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        total += sum(_count(allocatable.get(r)) for r in ACCELERATOR_RESOURCES)
    allocated = 0
    for pod in pods:
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        for container in (pod.get("spec") or {}).get("containers") or []:
            requests = (container.get("resources") or {}).get("requests") or {}
            allocated += sum(_count(requests.get(r)) for r in ACCELERATOR_RESOURCES)
    return {"total": total, "allocated": allocated}


def _count(value: Any) -> int:
    try:
        return int(str(value)) if value is not None else 0
    except ValueError:
        return 0


def free_gpus(status: Mapping[str, Any] | None) -> int | None:
    """Free accelerators from a Cluster's status (the controller's summary); None: not known."""
    gpus = (status or {}).get("gpus")
    if not isinstance(gpus, Mapping) or "total" not in gpus:
        return None
    return max(_count(gpus.get("total")) - _count(gpus.get("allocated")), 0)


def _time(now: float) -> str:
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def cluster_status(state: MemberHealth | None, wall_last_seen: float | None) -> dict[str, Any]:
    """A Cluster's status from its newest probe (`wall_last_seen`: the probe's wall-clock time)."""
    if state is None:
        return {"reachable": "Unknown", "reason": "not probed yet"}
    status: dict[str, Any] = {"reachable": "True" if state.reachable else "False", "reason": state.reason}
    if state.latency_s is not None:
        status["latencyMs"] = round(state.latency_s * 1000, 1)
    if wall_last_seen is not None:
        status["lastSeen"] = _time(wall_last_seen)
    if state.report is not None:
        reports = {r.model: r for r in state.report.models.values()}
        status["models"] = [
            {
                "name": name,
                "ready": r.ready_endpoints > 0,
                "readyEndpoints": r.ready_endpoints,
                "queued": r.queued,
                "inFlight": r.in_flight,
            }
            for name, r in sorted(reports.items())
        ]
        status["readyModels"] = sum(1 for r in reports.values() if r.ready_endpoints > 0)
    return status


def federated_status(
    model: FederatedModel,
    members: Iterable[Member],
    health: Mapping[str, MemberHealth],
    member_phases: Mapping[str, Mapping[str, Any] | None] | None = None,
) -> dict[str, Any]:
    """A FederatedModel's status: one entry per placed cluster (ready from the probe, phase and
    replicas from the member Model's own status where the controller could read it), and a
    summary such as `east=Ready west=Idle` for kubectl."""
    phases = member_phases or {}
    names = client_names(model)
    entries = []
    for member in placed(model, members):
        state = health.get(member.name)
        report = state.report.find(names) if state is not None and state.report is not None else None
        reachable = bool(state and state.reachable)
        ready = reachable and report is not None and report.ready_endpoints > 0
        entry: dict[str, Any] = {"cluster": member.name, "reachable": reachable, "ready": ready}
        member_status = phases.get(member.name)
        if member_status:
            entry["phase"] = str(member_status.get("phase", ""))
            entry["readyReplicas"] = int(member_status.get("readyReplicas", 0) or 0)
        if not reachable:
            entry["phase"] = "Unreachable"
            entry["reason"] = state.reason if state is not None else "not probed yet"
        elif report is None:
            entry["phase"] = "NotServed"
            entry["reason"] = "the member gateway does not serve this model"
        elif "phase" not in entry:
            entry["phase"] = "Ready" if ready else "Idle"
        entries.append(entry)
    return {
        "clusters": entries,
        "placed": len(entries),
        "readyClusters": sum(1 for e in entries if e["ready"]),
        "summary": " ".join(f"{e['cluster']}={e['phase'] or ('Ready' if e['ready'] else 'Idle')}" for e in entries),
    }
