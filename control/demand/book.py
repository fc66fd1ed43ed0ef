"""The demand book: per-model demand summed over gateways, from their reports. Pure: no I/O.

Every gateway process reports its per-model demand (queued cold requests,
in-flight requests, activation leases) with its gateway id, a process-unique
instance id and a strictly increasing sequence. The book keeps the newest
report per gateway, drops stale and replayed ones, forgets a member silent for
`member_ttl` seconds or one that withdraws, and bounds members and values so a
misbehaving reporter cannot grow memory or inflate demand without limit. A
member that withdrew or expired leaves a tombstone (its instance and last
sequence), and a gateway's previous instances are remembered, so replaying an
old report cannot bring a share back. Memory only: after a restart, reports
rebuild the state within one interval.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from wakegate.v1 import demand_pb2

log = logging.getLogger("wakegate.demand")


@dataclass(frozen=True, slots=True)
class ModelLoad:
    queued: int = 0
    in_flight: int = 0
    leases: int = 0
    #: Smallest failures_seen among live leases: a lease begun after the newest
    #: failed activation may start another one.
    newest_failures_seen: int = 0

    @property
    def demand(self) -> int:
        return self.queued + self.in_flight


@dataclass(slots=True)
class AdapterLoad:
    """One on-demand LoRA adapter of a model, summed over gateways: requests held for it (anywhere,
    or per endpoint), and per endpoint the requests in flight with it and routed with it so far."""

    queued: int = 0
    wanted: dict[str, int] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)
    routed: dict[str, int] = field(default_factory=dict)

    @property
    def held(self) -> int:
        return self.queued + sum(self.wanted.values())


@dataclass(slots=True)
class _Member:
    instance: str
    sequence: int
    seen_at: float
    models: dict[str, ModelLoad]
    #: Earlier instances of this gateway id (restarts): their reports are replays.
    retired: tuple[str, ...] = ()
    #: model -> its on-demand adapters as this gateway reported them
    adapters: dict[str, tuple[demand_pb2.AdapterDemand, ...]] = field(default_factory=dict)


#: Earlier instances remembered per gateway id.
_RETIRED_KEPT = 4


@dataclass
class Limits:
    member_ttl: float = 10.0
    max_members: int = 256
    max_models_per_report: int = 10_000
    max_value: int = 1_000_000
    #: Serialized size of one report; larger ones are refused as oversized.
    max_report_bytes: int = 1 << 20
    max_model_key: int = 253
    #: Reports handled at once by one server (gRPC refuses more with RESOURCE_EXHAUSTED).
    max_concurrent_reports: int = 64
    #: Tombstones of withdrawn or expired members kept against replays.
    max_tombstones: int = 1024


@dataclass
class Rejections:
    stale: int = 0
    oversized: int = 0
    too_many_members: int = 0
    unauthenticated: int = 0
    invalid: int = 0

    def counts(self) -> dict[str, int]:
        """Rejections by reason (the label of the rejections metric)."""
        return {
            "stale": self.stale,
            "oversized": self.oversized,
            "too_many_members": self.too_many_members,
            "unauthenticated": self.unauthenticated,
            "invalid": self.invalid,
        }


@dataclass
class DemandBook:
    limits: Limits = field(default_factory=Limits)
    rejections: Rejections = field(default_factory=Rejections)
    _members: dict[str, _Member] = field(default_factory=dict)
    #: gateway id -> the member it was when it withdrew or expired (insertion order = age).
    _tombstones: dict[str, _Member] = field(default_factory=dict)

    def apply(self, report: demand_pb2.DemandReport, now: float) -> tuple[bool, str]:
        """Take one report; returns (accepted, reason when refused)."""
        if not report.gateway_id or not report.instance:
            self.rejections.invalid += 1
            return False, "gateway_id and instance are required"
        if len(report.models) > self.limits.max_models_per_report:
            self.rejections.oversized += 1
            return False, f"report names more than {self.limits.max_models_per_report} models"
        if report.ByteSize() > self.limits.max_report_bytes:
            self.rejections.oversized += 1
            return False, f"report is larger than {self.limits.max_report_bytes} bytes"
        member = self._members.get(report.gateway_id)
        last = member if member is not None else self._tombstones.get(report.gateway_id)
        if last is not None:
            if report.instance in last.retired:
                self.rejections.stale += 1
                return False, f"instance {report.instance} of {report.gateway_id} was replaced"
            if last.instance == report.instance and report.sequence <= last.sequence:
                self.rejections.stale += 1
                return False, f"stale sequence {report.sequence} <= {last.sequence}"
        if report.withdraw:
            if member is not None and member.instance == report.instance:
                del self._members[report.gateway_id]
                member.sequence = report.sequence
                self._bury(report.gateway_id, member)
            return True, ""
        if member is None:
            self.expire(now)
            if len(self._members) >= self.limits.max_members:
                self.rejections.too_many_members += 1
                return False, f"more than {self.limits.max_members} gateways report"
        cap = self.limits.max_value
        models: dict[str, ModelLoad] = {}
        adapters: dict[str, tuple[demand_pb2.AdapterDemand, ...]] = {}
        for entry in report.models:
            if not entry.model or len(entry.model) > self.limits.max_model_key:
                self.rejections.invalid += 1
                return False, f"model key must be 1..{self.limits.max_model_key} characters"
            if entry.queued > cap or entry.in_flight > cap or entry.leases > cap:
                self.rejections.oversized += 1
                return False, f"values for {entry.model!r} exceed {cap}"
            if any(a.queued > cap or any(u.queued > cap or u.in_flight > cap for u in a.uses) for a in entry.adapters):
                self.rejections.oversized += 1
                return False, f"adapter values for {entry.model!r} exceed {cap}"
            models[entry.model] = ModelLoad(entry.queued, entry.in_flight, entry.leases, entry.failures_seen)
            if entry.adapters:
                adapters[entry.model] = tuple(entry.adapters)
        retired: tuple[str, ...] = ()
        if last is not None:
            retired = last.retired
            if last.instance != report.instance:
                # A new instance under the same gateway id replaces the old one (restart).
                retired = (*last.retired, last.instance)[-_RETIRED_KEPT:]
        self._tombstones.pop(report.gateway_id, None)
        self._members[report.gateway_id] = _Member(report.instance, report.sequence, now, models, retired, adapters)
        return True, ""

    def _bury(self, gateway_id: str, member: _Member) -> None:
        member.models = {}
        member.adapters = {}
        self._tombstones.pop(gateway_id, None)
        self._tombstones[gateway_id] = member
        while len(self._tombstones) > self.limits.max_tombstones:
            del self._tombstones[next(iter(self._tombstones))]

    def expire(self, now: float) -> list[str]:
        gone = [gid for gid, m in self._members.items() if now - m.seen_at > self.limits.member_ttl]
        for gid in gone:
            self._bury(gid, self._members.pop(gid))
            log.warning("demand member expired gateway=%s (silent for %.0fs)", gid, self.limits.member_ttl)
        return gone

    def next_expiry(self) -> float | None:
        if not self._members:
            return None
        return min(m.seen_at for m in self._members.values()) + self.limits.member_ttl

    @property
    def members(self) -> int:
        return len(self._members)

    def totals(self) -> dict[str, ModelLoad]:
        """Per-model sums over the newest report of every live member."""
        sums: dict[str, list[int]] = {}
        for member in self._members.values():
            for key, load in member.models.items():
                acc = sums.setdefault(key, [0, 0, 0, -1])
                acc[0] += load.queued
                acc[1] += load.in_flight
                acc[2] += load.leases
                if load.leases:
                    acc[3] = max(acc[3], load.newest_failures_seen)
        return {k: ModelLoad(q, f, le, max(s, 0)) for k, (q, f, le, s) in sums.items()}

    def adapter_totals(self, key: str) -> dict[str, AdapterLoad]:
        """Adapter (served name) -> its demand for model `key`, summed over every live member."""
        out: dict[str, AdapterLoad] = {}
        for member in self._members.values():
            for demand in member.adapters.get(key, ()):
                total = out.setdefault(demand.adapter, AdapterLoad())
                total.queued += demand.queued
                for use in demand.uses:
                    ep = use.endpoint
                    if use.queued:
                        total.wanted[ep] = total.wanted.get(ep, 0) + use.queued
                    if use.in_flight:
                        total.in_flight[ep] = total.in_flight.get(ep, 0) + use.in_flight
                    total.routed[ep] = total.routed.get(ep, 0) + use.routed
        return out
