"""Predictive wake in `wakegate up`: demand history per model, kept across restarts, and the
speculative wakes it leads to (control/scaling/predict.py decides; this module applies and measures).

Every model's demand onsets (the first request after its idle gap: held or in flight in the demand
book, or counted by Envoy) go into the history, saved to the state directory
(`demand-history.json`, written aside and renamed, at most every 5 s and when `up` stops) and read
at start.
For a model with `scaling.predictive.enabled`, at zero or asleep, each evaluation asks for the next
predicted onset; `leadSeconds` before it, while the budget allows, the model is held up as an
activation lease would hold it (`Core.speculate`) until the prediction's tolerance has passed. A
demand onset while it is warm for a prediction is a hit; the tolerance passing without one is a
miss, and the model goes back to where it was (asleep, or zero) at once. Every first request is
counted as having found the model warm or not, predictive or not, so the two can be compared.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from wakegate.control.scaling.core import Core, Verdict
from wakegate.control.scaling.predict import History, Policy, Prediction, Speculation, predict
from wakegate.control.up.runtime import ModelRuntime

log = logging.getLogger("wakegate.up")

HISTORY_FILE = "demand-history.json"
#: The history is written at most this often (the whole file each time), and when `up` stops.
SAVE_EVERY = 5.0


def policy_of(runtime: ModelRuntime) -> Policy | None:
    spec = runtime.model.spec.scaling.predictive
    if not spec.enabled:
        return None
    return Policy(lead=float(spec.leadSeconds), budget=float(spec.budgetSeconds), period=float(spec.periodSeconds))


class Predictive:
    def __init__(
        self,
        runtimes: Mapping[str, ModelRuntime],
        core: Core,
        path: Path | None,
        *,
        warm_seconds: Callable[[str, float, float], float] = lambda model, since, until: 0.0,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.runtimes = runtimes
        #: The scaling core whose verdicts it reads and whose leases it extends (`speculate`).
        self.core = core
        #: Where the history is kept (None: memory only).
        self.path = path
        self.history = self._load()
        self._dirty = False
        self._saved_at = -SAVE_EVERY
        #: Accelerator-seconds a model spent warm between two wall-clock times (the savings ledger).
        self._warm_seconds, self._wall = warm_seconds, wall
        #: A speculative wake began in the last evaluation: evaluate again at once.
        self.started = False
        self.speculation = {
            key: Speculation(policy) for key, rt in runtimes.items() if (policy := policy_of(rt)) is not None
        }
        self._busy: dict[str, bool] = {}
        #: model -> when it last had requests held or in flight (monotonic)
        self._last_demand: dict[str, float] = {}
        #: model -> [first requests that found it warm, that did not]
        self.first_requests: dict[str, list[int]] = {key: [0, 0] for key in runtimes}
        #: model -> (the prediction a wake is for, when the tolerance after it passes: monotonic)
        self._pending: dict[str, tuple[Prediction, float]] = {}
        self._next: dict[str, Prediction | None] = {}
        #: model -> (onsets added when predicted, the prediction, recompute after: wall clock)
        self._cache: dict[str, tuple[int, Prediction | None, float]] = {}
        #: Hooks: a speculative wake settled (model, outcome, accelerator-seconds spent); a first request.
        self.on_outcome: Callable[[str, str, float], None] = lambda model, outcome, spent: None
        self.on_first_request: Callable[[str, bool], None] = lambda model, warm: None

    # -- history ---------------------------------------------------------------------------------

    def _load(self) -> History:
        if self.path is None or not self.path.exists():
            return History()
        try:
            return History.from_json(self.path.read_text())
        except (OSError, ValueError) as exc:
            log.warning("demand history unreadable, starting without it path=%s: %s", self.path, exc)
            return History()

    def _save(self) -> None:
        """Write the history soon: at once when the last write is SAVE_EVERY old, else at the first
        evaluation after that (or at `flush`)."""
        self._dirty = True
        now = time.monotonic()
        if now - self._saved_at >= SAVE_EVERY:
            self.flush()

    def flush(self) -> None:
        """Write the history now if it changed."""
        if self.path is None or not self._dirty:
            return
        self._dirty, self._saved_at = False, time.monotonic()
        aside = self.path.with_suffix(".tmp")
        try:
            aside.write_text(self.history.to_json())
            os.replace(aside, self.path)
        except OSError as exc:
            log.warning("demand history not saved path=%s: %s", self.path, exc)

    # -- evaluation ------------------------------------------------------------------------------

    def evaluate(self, verdicts: Mapping[str, Verdict], now: float) -> float | None:
        """Record onsets, settle and start speculative wakes; the next time to evaluate (monotonic)."""
        wall = self._wall()
        self.started = False
        for key, speculation in self.speculation.items():
            if (episode := speculation.open) is not None:
                episode.spent = self._warm_seconds(key, episode.woke_at, wall)
        onsets = False
        for key in verdicts:
            runtime = self.runtimes[key]
            # Requests held or in flight (a lease outlives its requests: not an onset).
            load = self.core.loads.get(key)
            busy = load is not None and load.demand > 0
            last = self._last_demand.get(key)
            if busy and not self._busy.get(key, False) and (last is None or now - last >= self._gap(runtime)):
                onsets = True
                self._onset(key, runtime, wall, now)
            if busy or self._busy.get(key, False):
                self._last_demand[key] = now
            self._busy[key] = busy
        if onsets or self._dirty:
            self._save()
        checks: list[float] = [now + SAVE_EVERY] if self._dirty else []
        for key, speculation in self.speculation.items():
            at = self._consider(key, speculation, now, wall)
            if at is not None:
                checks.append(at)
        return min(checks, default=None)

    def requests_seen(self, key: str, now: float) -> bool:
        """Envoy routed requests of `key` to its backends since the last look (its counters, polled):
        a request too short for the demand reports still marks activity, and may be a first one."""
        runtime = self.runtimes.get(key)
        if runtime is None:
            return False
        last = self._last_demand.get(key)
        onset = not self._busy.get(key, False) and (last is None or now - last >= self._gap(runtime))
        if onset:
            self._onset(key, runtime, self._wall(), now)
            self._save()
        self._last_demand[key] = now
        return onset

    @staticmethod
    def _gap(runtime: ModelRuntime) -> float:
        """Idle seconds after which a request counts as a first one: when the model would have left
        warm (its sleepAfter, else its idleTimeout); requests closer together are one session."""
        scaling = runtime.model.spec.scaling
        return float(scaling.sleepAfter if scaling.sleepAfter is not None else scaling.idleTimeout)

    def speculating(self, key: str) -> bool:
        """Whether `key` is held up for a prediction no demand has come for yet."""
        return key in self._pending

    def _onset(self, key: str, runtime: ModelRuntime, wall: float, now: float) -> None:
        self.history.add(key, wall)
        warm = bool(runtime.ready_endpoints)
        self.first_requests[key][0 if warm else 1] += 1
        self.on_first_request(key, warm)
        if key in self._pending and (speculation := self.speculation.get(key)) is not None:
            del self._pending[key]
            # Demand came for it: a hit if it found the model warm, late if the wake was not done.
            outcome = "hit" if warm else "late"
            episode = speculation.settle(outcome)
            if episode is not None:
                log.info("predictive wake %s model=%s spent=%.1fs (%s)", outcome, key, episode.spent,
                         episode.prediction.why)
                self.on_outcome(key, outcome, episode.spent)

    def _consider(self, key: str, speculation: Speculation, now: float, wall: float) -> float | None:
        runtime = self.runtimes[key]
        pending = self._pending.get(key)
        if pending is not None:
            _, expires = pending
            if now < expires:
                return expires
            del self._pending[key]
            self.core.unspeculate(key, now)
            if runtime.can_sleep:
                runtime.want_asleep(True)
            episode = speculation.settle("miss")
            if episode is not None:
                log.info("predictive wake miss model=%s wasted=%.1fs (%s)", key, episode.spent,
                         episode.prediction.why)
                self.on_outcome(key, "miss", episode.spent)
            return None
        if self._busy.get(key):
            self._next[key] = None
            return None
        # A prediction holds until the history changes or a recheck is due (a new candidate time can
        # come within reach as time passes): a quiet model costs a comparison per evaluation.
        count = self.history.added.get(key, 0)
        cached = self._cache.get(key)
        if cached is not None and cached[0] == count and wall < cached[2]:
            prediction = cached[1]
        else:
            prediction = predict(self.history.of(key), wall, speculation.policy)
            self._cache[key] = (count, prediction, wall + speculation.policy.tolerance / 2)
        self._next[key] = prediction
        recheck = now + (self._cache[key][2] - wall)
        if prediction is None:
            return recheck
        wake_wall = prediction.at - speculation.policy.lead
        if wall < wake_wall:
            return min(recheck, now + (wake_wall - wall))
        if not speculation.affordable(wall):
            return recheck
        expires = now + (prediction.at - wall) + speculation.policy.tolerance
        self._pending[key] = (prediction, expires)
        speculation.woke(prediction, wall)
        self.core.speculate(key, expires)
        self.started = True
        # A warm model is kept warm for it (its idle time no longer counts); asleep or zero, it wakes.
        log.info("predictive wake model=%s tier=%s predicted_in=%.1fs: %s", key, runtime.tier.value,
                 prediction.at - wall, prediction.why)
        return expires

    # -- status ----------------------------------------------------------------------------------

    def status(self, key: str) -> dict[str, Any]:
        found = self.first_requests.get(key, [0, 0])
        out: dict[str, Any] = {
            "enabled": key in self.speculation,
            "history_onsets": len(self.history.of(key)),
            "first_requests": {"found_warm": found[0], "found_cold": found[1]},
        }
        speculation = self.speculation.get(key)
        if speculation is not None:
            prediction = self._next.get(key)
            out["next"] = None if prediction is None else {
                "at": prediction.at,
                "wake_at": prediction.at - speculation.policy.lead,
                "why": prediction.why,
            }
            out.update(speculation.status(self._wall()))
        return out
