"""The idle tiers of a model's replicas under `wakegate up`: warm, asleep (the engine let go of
the accelerator, the process lives) and zero; putting replicas to sleep and waking them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

import aiohttp

from wakegate.control.backends.base import Backend
from wakegate.control.schema import Model
from wakegate.control.up.engine import Engine, EngineError
from wakegate.control.up.gpus import GpuPool
from wakegate.control.up.replica import DORMANT, Replica, ReplicaState, RuntimeSettings, Tier

if TYPE_CHECKING:
    from wakegate.control.up.runtime import ModelRuntime

log = logging.getLogger("wakegate.up")


def _size_of(path: Path) -> int:
    """Bytes of a weight file, or of every file under a weight folder."""
    try:
        if path.is_file():
            return path.stat().st_size
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    except OSError:
        return 0


def _host_memory_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


class IdleTiers:
    """The tiers of one model's replicas (a part of `ModelRuntime`, runtime.py, which holds the state)."""

    if TYPE_CHECKING:
        model: Model
        backend: Backend
        settings: RuntimeSettings
        gpus: GpuPool
        replicas: list[Replica]
        weights: Path | None
        sleep_refused: str
        last_wake_from_asleep: float | None
        on_woken: Callable[[ModelRuntime, float], None] | None
        on_tier: Callable[[ModelRuntime], None] | None
        _wake_asked: float | None
        _asleep_wanted: bool
        _tier_task: asyncio.Task[None] | None
        _last_tier: tuple[Tier, int]

        @property
        def live_count(self) -> int: ...
        @property
        def gpus_per_replica(self) -> int: ...
        def _values(self, replica: Replica) -> dict[str, str]: ...
        def _changed(self) -> None: ...
        async def _drain(self, replica: Replica) -> None: ...

    @property
    def tier(self) -> Tier:
        """zero: no process; asleep: every process sleeps; else warm (going to sleep included)."""
        if not self.replicas:
            return Tier.ZERO
        if all(r.state is ReplicaState.ASLEEP for r in self.replicas):
            return Tier.ASLEEP
        return Tier.WARM

    @property
    def awake_count(self) -> int:
        """Processes that hold (or are about to hold) the accelerator: live ones less the sleeping."""
        return self.live_count - sum(1 for r in self.replicas if r.state is ReplicaState.ASLEEP)

    @property
    def asleep_count(self) -> int:
        return sum(1 for r in self.replicas if r.state in DORMANT)

    def want_asleep(self, asleep: bool, asked: float | None = None) -> None:
        """Drive every replica to sleep (True) or awake (False); `asked` is when the demand that
        wakes it was seen (the wake's duration counts from there)."""
        if not asleep:
            self.sleep_refused = ""
            if self._wake_asked is None and self.asleep_count:
                self._wake_asked = asked if asked is not None else time.monotonic()
        elif self.sleep_refused:
            return
        self._asleep_wanted = asleep
        idle = self._tier_task is None or self._tier_task.done()
        moving = ReplicaState.READY if asleep else ReplicaState.ASLEEP
        if idle and any(r.state is moving for r in self.replicas):
            # Only when a replica has somewhere to go: a model that is already there costs no task.
            self._tier_task = asyncio.create_task(self._drive_tier(), name=f"tier-{self.model.name}")

    async def _drive_tier(self) -> None:
        while True:
            if self._asleep_wanted:
                targets = [r for r in self.replicas if r.state is ReplicaState.READY]
                if not targets or self.sleep_refused:
                    return
                why = self._sleep_not_allowed()
                if why:
                    self.sleep_refused = why
                    log.info("sleep skipped model=%s: %s", self.model.key, why)
                    return
                await asyncio.gather(*(self._sleep_replica(r) for r in targets))
            else:
                targets = [r for r in self.replicas if r.state is ReplicaState.ASLEEP]
                if not targets:
                    self._wake_asked = None
                    return
                await asyncio.gather(*(self._wake_replica(r) for r in targets))

    @property
    def tier_units(self) -> int:
        """Accelerators the tier counts (one per replica without any): the awake replicas' while
        warm, the sleeping ones' while asleep, one replica's at zero."""
        per = max(1, self.gpus_per_replica)
        tier = self.tier
        if tier is Tier.ZERO:
            return per
        if tier is Tier.ASLEEP:
            return per * len(self.replicas)
        return per * sum(1 for r in self.replicas if r.state is not ReplicaState.ASLEEP)

    def _note_tier(self) -> None:
        """Tell `on_tier` when the model's tier (or the accelerators it counts) changed."""
        now = (self.tier, self.tier_units)
        if now != self._last_tier:
            self._last_tier = now
            if self.on_tier is not None:
                self.on_tier(cast("ModelRuntime", self))

    def _sleep_not_allowed(self) -> str:
        """Why sleeping would not fit in memory now ("" when it does): level 1 keeps the weights in
        host memory (vLLM), so that much must be available."""
        level = self.model.spec.scaling.sleepLevel
        if not (self.backend.sleep_holds_weights and level == 1) or self.weights is None:
            return ""
        size = _size_of(self.weights)
        available = _host_memory_available()
        if available is not None and size * len(self.replicas) > available:
            return (f"level 1 keeps {size >> 20} MiB of weights per replica in host memory and "
                    f"{available >> 20} MiB are available")
        return ""

    def _engine(self, replica: Replica, session: aiohttp.ClientSession) -> Engine:
        return Engine(self.backend, session, self.settings.host, replica.port, self._values(replica), None)

    async def _sleep_replica(self, replica: Replica) -> None:
        """Unroute, drain, and ask the engine to sleep; a refusal keeps it warm (and is not retried
        until the next demand)."""
        replica.state = ReplicaState.SLEEPING
        self._changed()
        await asyncio.sleep(self.settings.unroute_delay)
        await self._drain(replica)
        level = self.model.spec.scaling.sleepLevel
        started = time.monotonic()
        async with aiohttp.ClientSession() as session:
            try:
                await self._engine(replica, session).sleep(level)
            except EngineError as exc:
                self.sleep_refused = str(exc)
                log.warning("sleep failed model=%s replica=%d: %s", self.model.key, replica.index, exc)
                if replica.state is ReplicaState.SLEEPING:
                    replica.state = ReplicaState.READY
                    self._changed()
                return
        if replica.state is not ReplicaState.SLEEPING:
            return  # stopped meanwhile
        replica.state = ReplicaState.ASLEEP
        replica.asleep_since = time.monotonic()
        replica.load = None
        self.gpus.doze(replica.gpu_owner, self.backend.asleep_vram_mb)
        log.info("replica asleep model=%s replica=%d level=%d seconds=%.3f", self.model.key, replica.index,
                 level, replica.asleep_since - started)
        self._changed()

    async def _wake_replica(self, replica: Replica) -> None:
        """Wake the engine and route it once it says the model is loaded; an engine that does not
        wake is stopped (the scaler starts a new one from zero)."""
        if not self.gpus.rouse(replica.gpu_owner):
            log.warning("wake model=%s replica=%d: its accelerator is taken; starting it anew",
                        self.model.key, replica.index)
            await replica.child.stop(self.backend.term_grace)
            return
        replica.state = ReplicaState.WAKING
        level = self.model.spec.scaling.sleepLevel
        async with aiohttp.ClientSession() as session:
            engine = self._engine(replica, session)
            try:
                await engine.wake(level)
                deadline = time.monotonic() + 30.0
                while not await engine.loaded():
                    if time.monotonic() > deadline:
                        raise EngineError("the model was not loaded 30s after the wake")
                    await asyncio.sleep(self.settings.probe_interval_loading)
            except EngineError as exc:
                log.warning("wake failed model=%s replica=%d: %s; stopping it", self.model.key, replica.index, exc)
                await replica.child.stop(self.backend.term_grace)
                return
        if replica.state is not ReplicaState.WAKING:
            return
        replica.state = ReplicaState.READY
        replica.ready_at = time.monotonic()
        replica.asleep_since = None
        asked = self._wake_asked if self._wake_asked is not None else replica.ready_at
        self.last_wake_from_asleep = replica.ready_at - asked
        log.info("replica awake model=%s replica=%d level=%d seconds=%.3f", self.model.key, replica.index,
                 level, self.last_wake_from_asleep)
        self._changed()
        if self.on_woken is not None:
            self.on_woken(cast("ModelRuntime", self), self.last_wake_from_asleep)

