"""Scaling verdicts for the models a scaler serves: summed demand in, replicas and activity out.

This module is pure. It owns, per model, the state that control/scaling's
`autoscale.decide` and, per GPU group, `arbitration.arbitrate` carry between
calls, and turns the DemandBook's per-model totals into a :class:`Verdict`:
the replica count the builtin engine applies, whether the model is active
(what KEDA's IsActive/StreamIsActive report) and the demand KEDA's GetMetrics
exposes. A member of a GPU group that does not hold the group is inactive
with 0 replicas and 0 demand. The caller evaluates on every demand change and
at the returned ``next_check_at``; no polling.

``live`` replica counts are optional (`wakegate up` passes its processes, the
cluster scaler its backend pods until they are deleted from the API, for either
engine; a scaler without a cluster has none): with them, an idle group holder
releases the group only once it has no replicas left, and the incoming member
starts only after the outgoing one stopped. Each verdict names the peer a
demanded group member waits for (``waiting_for``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from wakegate.control.demand.book import DemandBook, ModelLoad
from wakegate.control.scaling import arbitration, autoscale
from wakegate.control.schema import Model

__all__ = ["Core", "Verdict", "policy_of"]

_NO_LOAD = ModelLoad()


@dataclass(frozen=True, slots=True)
class Verdict:
    replicas: int
    active: bool
    #: queued + in-flight, summed over gateways (0 when arbitration holds the model back).
    demand: int
    #: queued + in-flight + leases > 0 (before arbitration).
    busy: bool
    target_in_flight: int
    #: False for a GPU-group member that does not hold the group (it waits, cold).
    admitted: bool = True
    #: The group peer a demanded member waits for: the holder, or (for the member the group was
    #: just handed to) the outgoing one whose replicas are not gone yet. None: not waiting.
    waiting_for: str | None = None
    #: The replicas the model's own demand wants, before its GPU group held it back (0: it idled).
    own_replicas: int = 0
    #: Since when it has had no demand (monotonic), None while busy.
    idle_since: float | None = None


@dataclass
class _Group:
    members: list[arbitration.Member]
    active: str | None = None
    active_since: float | None = None
    states: dict[str, arbitration.MemberState] = field(default_factory=dict)
    swaps: int = 0
    #: member -> the peer it waits for, from the last evaluation
    waiting: dict[str, str] = field(default_factory=dict)


def policy_of(model: Model) -> autoscale.Policy:
    scaling = model.spec.scaling
    return autoscale.Policy(
        min=scaling.min,
        max=scaling.max,
        idle_timeout=float(scaling.idleTimeout),
        target_in_flight=scaling.targetInFlight,
        scale_in_window=float(scaling.scaleInWindow),
    )


class Core:
    def __init__(self, book: DemandBook) -> None:
        self.book = book
        self.models: dict[str, Model] = {}
        self._scale: dict[str, autoscale.ScaleState] = {}
        self._groups: dict[str, _Group] = {}
        self.verdicts: dict[str, Verdict] = {}
        self.loads: dict[str, ModelLoad] = {}
        self._policies: dict[str, autoscale.Policy] = {}
        #: model -> (its demand and failed activations, desired replicas, busy, demand, next check)
        #: of its last decision: reused while the inputs are the same and the check is not due,
        #: so an evaluation costs a comparison per quiet model (autoscale.decide is stable then).
        self._decided: dict[str, tuple[tuple[ModelLoad, int, bool], int, bool, int, float | None]] = {}
        #: model -> until when a predictive wake holds it up as a lease would (monotonic)
        self._speculative: dict[str, float] = {}

    def speculate(self, key: str, until: float) -> None:
        """Hold `key` up as if one activation lease lived until `until` (a predictive wake)."""
        self._speculative[key] = until

    def unspeculate(self, key: str, now: float) -> None:
        """End a predictive wake no demand came for: the model idles from `now` as if it never woke."""
        if self._speculative.pop(key, None) is None:
            return
        state = self._scale.get(key)
        policy = self._policies.get(key)
        if state is not None and policy is not None and policy.min == 0:
            self._scale[key] = autoscale.ScaleState(replicas=0, idle_since=now)
            self._decided.pop(key, None)

    def set_models(self, models: Iterable[Model], now: float, current: Mapping[str, int] | None = None) -> None:
        """Replace the model set; state of models that stay is kept.

        A model seen for the first time starts from ``current[key]`` replicas (what
        its Deployment has now; 0 when unknown), idle since ``now``, so a restarted
        scaler neither wakes an idle model nor cuts a running one before its idle timeout.
        """
        current = current or {}
        before = self.models
        self.models = {m.key: m for m in models}
        # A model that is the same object as before keeps its policy and its last decision.
        for key, model in self.models.items():
            if before.get(key) is not model:
                self._policies[key] = policy_of(model)
                self._decided.pop(key, None)
        for key in [k for k in self._policies if k not in self.models]:
            del self._policies[key]
            self._decided.pop(key, None)
        for key in list(self._scale):
            if key not in self.models:
                del self._scale[key]
                self.verdicts.pop(key, None)
        for key, model in self.models.items():
            if key not in self._scale:
                policy = policy_of(model)
                start = min(max(current.get(key, 0), policy.min), policy.max)
                self._scale[key] = autoscale.ScaleState(replicas=start, idle_since=now)
        groups: dict[str, list[arbitration.Member]] = {}
        for key, model in self.models.items():
            gpu = model.spec.gpu
            if gpu.shared:
                namespace = model.metadata.namespace
                group_key = f"{namespace}/{gpu.shared}" if namespace else gpu.shared
                groups.setdefault(group_key, []).append(
                    arbitration.Member(
                        key=key,
                        priority=gpu.priority,
                        min_run_seconds=gpu.minRunSeconds,
                        swap_cooldown_seconds=gpu.swapCooldownSeconds,
                        demand_window_seconds=gpu.demandWindowSeconds,
                        queue_threshold=gpu.queueThreshold,
                    )
                )
        for name in list(self._groups):
            if name not in groups:
                del self._groups[name]
        for name, members in groups.items():
            group = self._groups.get(name)
            if group is None:
                # After a restart, a member that is running holds the group.
                running = [m.key for m in members if self._scale[m.key].replicas > 0]
                self._groups[name] = _Group(members, running[0], now) if running else _Group(members)
                continue
            group.members = members
            keys = {m.key for m in members}
            group.states = {k: v for k, v in group.states.items() if k in keys}
            if group.active is not None and group.active not in keys:
                group.active, group.active_since = None, None

    def group_active(self, name: str) -> str | None:
        return self._groups[name].active

    @property
    def swaps(self) -> dict[str, int]:
        return {name: group.swaps for name, group in self._groups.items()}

    def resync(self, key: str, replicas: int) -> None:
        """Replicas went away without a verdict (a failed load that is not retried): start from there."""
        state = self._scale.get(key)
        if state is not None and state.replicas != replicas:
            self._scale[key] = replace(state, replicas=replicas)
            self._decided.pop(key, None)

    def _load(
        self, key: str, load: ModelLoad, failures: Mapping[str, int], speculative: bool = False
    ) -> autoscale.Load:
        # A lease that began before the model's newest failed activation must not start another
        # one; the requests it held were failed with that activation.
        if load.leases and load.newest_failures_seen < failures.get(key, 0) and not speculative:
            return autoscale.Load(queued=0, in_flight=load.in_flight, leases=0)
        return autoscale.Load(queued=load.queued, in_flight=load.in_flight, leases=load.leases)

    def evaluate(
        self, now: float, live: Mapping[str, int] | None = None, failures: Mapping[str, int] | None = None
    ) -> tuple[dict[str, Verdict], float | None]:
        """Verdicts for every model at ``now`` and when to evaluate again without a demand change.

        ``failures`` (model -> failed activations so far) keeps stale leases from re-waking a model
        whose load just failed.
        """
        failures = failures or {}
        self.book.expire(now)
        self.loads = self.book.totals()
        next_checks: list[float] = []
        expiry = self.book.next_expiry()
        if expiry is not None:
            next_checks.append(expiry)
        wanted: dict[str, int] = {}
        busy: dict[str, bool] = {}
        demand: dict[str, int] = {}
        own: dict[str, int] = {}
        for key in self.models:
            raw = self.loads.get(key, _NO_LOAD)
            until = self._speculative.get(key)
            speculative = until is not None and now < until
            if until is not None and speculative:
                next_checks.append(until)
            elif until is not None:
                del self._speculative[key]
            if speculative:
                raw = replace(raw, leases=raw.leases + 1)
            inputs = (raw, failures.get(key, 0), speculative)
            last = self._decided.get(key)
            if last is not None and last[0] == inputs and (last[4] is None or last[4] > now):
                _, desired, busy[key], demand[key], next_at = last
            else:
                load = self._load(key, raw, failures, speculative)
                busy[key] = load.queued + load.in_flight + load.leases > 0
                demand[key] = load.queued + load.in_flight
                desired, self._scale[key], next_at = autoscale.decide(self._policies[key], load, self._scale[key], now)
                self._decided[key] = (inputs, desired, busy[key], demand[key], next_at)
            wanted[key] = desired
            own[key] = desired
            if next_at is not None:
                next_checks.append(next_at)
        for group in self._groups.values():
            next_at = self._arbitrate(group, wanted, busy, demand, now, live)
            if next_at is not None:
                next_checks.append(next_at)
        held_back = {m.key for g in self._groups.values() for m in g.members if m.key != g.active}
        waiting = {key: peer for g in self._groups.values() for key, peer in g.waiting.items()}
        self.verdicts = {
            key: Verdict(
                replicas=wanted[key],
                active=wanted[key] > 0,
                demand=0 if key in held_back else self.loads.get(key, _NO_LOAD).demand,
                busy=busy[key],
                target_in_flight=self._policies[key].target_in_flight,
                admitted=key not in held_back,
                waiting_for=waiting.get(key),
                own_replicas=own[key],
                idle_since=self._scale[key].idle_since,
            )
            for key in self.models
        }
        return self.verdicts, min(next_checks, default=None)

    def _arbitrate(
        self,
        group: _Group,
        wanted: dict[str, int],
        busy: dict[str, bool],
        demand: Mapping[str, int],
        now: float,
        live: Mapping[str, int] | None,
    ) -> float | None:
        def running(key: str) -> int:
            return wanted[key] if live is None else live.get(key, 0)

        for member in group.members:
            previous = group.states.get(member.key, arbitration.MemberState())
            since = (previous.demand_since if previous.demand_since is not None else now) if busy[member.key] else None
            group.states[member.key] = arbitration.MemberState(since, previous.swapped_out_at, demand[member.key])
        if group.active is not None and wanted[group.active] == 0 and running(group.active) == 0:
            group.active, group.active_since = None, None
        decision = arbitration.arbitrate(group.members, group.states, group.active, group.active_since, now)
        if decision.active != group.active:
            if decision.swapped_out is not None:
                old = group.states.get(decision.swapped_out, arbitration.MemberState())
                group.states[decision.swapped_out] = replace(old, swapped_out_at=now)
                group.swaps += 1
            group.active = decision.active
            group.active_since = now if decision.active is not None else None
        group.waiting = {}
        for member in group.members:
            if member.key != group.active:
                wanted[member.key] = 0
                if group.active is not None and busy[member.key]:
                    group.waiting[member.key] = group.active
        # The incoming member starts only once every other member's replicas are gone.
        outgoing = sorted(m.key for m in group.members if m.key != group.active and running(m.key) > 0)
        if group.active is not None and live is not None and outgoing:
            if wanted[group.active] > live.get(group.active, 0):
                group.waiting[group.active] = outgoing[0]
            wanted[group.active] = min(wanted[group.active], live.get(group.active, 0))
        return decision.next_check_at
