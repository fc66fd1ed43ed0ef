"""Local runtime for `wakegate up`: backend processes per model, their health, and what is routable.

Each model runs `replicas` backend processes on loopback ports. A replica is
routable once its health path answers 200; a replica whose process exits is
taken out of the routes at once and restarted with capped backoff. Every change
of routable endpoints is pushed to `on_change` (the xDS feeder), never polled
by the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import aiohttp

from wakegate.control.admin import free_port
from wakegate.control.backends import BACKENDS
from wakegate.control.feeder.resources import RoutedModel, routed_model
from wakegate.control.schema import Model
from wakegate.control.up.children import Child
from wakegate.control.up.gpus import GpuPool, Slot, visible_devices_env

log = logging.getLogger("wakegate.up")


class ReplicaState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    STOPPED = "stopped"


@dataclass
class RuntimeSettings:
    """Knobs of the local runtime; one object per `up` process."""

    #: Where backend logs go: one file per replica.
    log_dir: Path = Path(".wakegate/logs")
    host: str = "127.0.0.1"
    #: Health probe period while a replica loads (short: readiness is noticed within this
    #: long, and held requests wait for it), and once it is ready.
    probe_interval_loading: float = 0.02
    probe_interval_ready: float = 2.0
    #: Restart backoff bounds after a crash.
    restart_backoff_min: float = 1.0
    restart_backoff_max: float = 30.0
    #: Grace given to a backend on stop before SIGKILL; in-flight streams finish within it.
    stop_grace: float = 30.0
    #: Pause between taking a replica out of the routes and signalling it, so that no
    #: request is sent to a backend that stopped listening (Envoy applies the push in ms).
    unroute_delay: float = 0.5


@dataclass
class Replica:
    index: int
    port: int
    child: Child
    state: ReplicaState = ReplicaState.STARTING
    started_at: float = field(default_factory=time.monotonic)
    ready_at: float | None = None
    restarts: int = 0
    task: asyncio.Task[None] | None = None
    gpu_owner: str = ""


class ModelRuntime:
    """The replicas of one model."""

    def __init__(
        self, model: Model, settings: RuntimeSettings, on_change: Callable[[], None], gpus: GpuPool | None = None
    ) -> None:
        self.model = model
        self.gpus = gpus if gpus is not None else GpuPool()
        self.backend = BACKENDS[model.spec.backend]
        self.settings = settings
        self._on_change = on_change
        self.replicas: list[Replica] = []
        self._stopping = 0
        self._indexes = itertools.count()
        self.generation = 0
        self.failed_activations = 0
        self.last_failure = ""
        #: False while a GPU-group peer holds the accelerator.
        self.admitted = True
        #: Seconds from the scale-from-zero decision to the first ready replica, last time.
        self.last_cold_start: float | None = None
        #: Hooks for the scaler and metrics: a replica spawned, became ready, or exited for good.
        self.on_spawned: Callable[[ModelRuntime, Replica], None] | None = None
        self.on_ready: Callable[[ModelRuntime, Replica], None] | None = None
        self.on_exit: Callable[[ModelRuntime], None] | None = None
        self.on_activation_failed: Callable[[ModelRuntime, str], None] | None = None

    @property
    def ready_endpoints(self) -> tuple[tuple[str, int], ...]:
        return tuple((self.settings.host, r.port) for r in self.replicas if r.state is ReplicaState.READY)

    def routed(self) -> RoutedModel:
        return routed_model(
            self.model,
            self.ready_endpoints,
            generation=self.generation,
            failed_activations=self.failed_activations,
            last_failure=self.last_failure,
            admitted=self.admitted,
        )

    @property
    def replica_count(self) -> int:
        """Replicas the model is meant to have (starting, ready or restarting)."""
        return len(self.replicas)

    @property
    def live_count(self) -> int:
        """Processes of this model that exist, including replicas being stopped."""
        return len(self.replicas) + self._stopping

    async def scale_to(self, count: int) -> None:
        if count != len(self.replicas):
            log.info("scale model=%s from=%d to=%d", self.model.key, len(self.replicas), count)
        while len(self.replicas) < count:
            if self._start_replica() is None:
                log.warning(
                    "scale capped model=%s replicas=%d wanted=%d: not enough free GPUs",
                    self.model.key,
                    len(self.replicas),
                    count,
                )
                break
        while len(self.replicas) > count:
            replica = self.replicas.pop()
            await self._stop_replica(replica)

    async def stop(self) -> None:
        await asyncio.gather(*(self._stop_replica(r) for r in self.replicas))
        self.replicas.clear()

    # -- replicas ---------------------------------------------------------------------------------

    def _argv(self, port: int) -> list[str]:
        command = self.backend.render_command(
            host=self.settings.host, port=port, model=self.model.name, served_name=self.model.served_name
        )
        return command + list(self.model.spec.args)

    def _env(self, port: int, gpus: list[Slot]) -> dict[str, str]:
        env = dict(os.environ)
        values = {"host": self.settings.host, "port": str(port)}
        env.update({k: v.format(**values) for k, v in self.backend.env.items()})
        env.update(visible_devices_env(gpus))
        env.update(self.model.spec.env)
        return env

    @property
    def capacity(self) -> int:
        """Replicas this machine can run now: the current ones plus what the free GPUs allow."""
        need = self.gpus_per_replica
        if need == 0:
            return self.model.spec.scaling.max
        vendor = self.model.spec.resources.gpu.vendor
        vendors = (vendor,) if vendor else self.backend.gpu_vendors
        free = max((sum(1 for s in self.gpus.free if s.vendor == v) for v in vendors), default=0)
        return len(self.replicas) + free // need

    @property
    def gpus_per_replica(self) -> int:
        """`resources.gpu.count`, or one GPU for a GPU backend on a machine that has any."""
        wanted = self.model.spec.resources.gpu.count
        if wanted:
            return wanted
        return 1 if self.backend.gpu_vendors and self.gpus.slots else 0

    def _start_replica(self) -> Replica | None:
        index = next(self._indexes)
        owner = f"{self.model.key}#{index}"
        gpu = self.model.spec.resources.gpu
        slots = self.gpus.allocate(owner, self.gpus_per_replica, self.backend.gpu_vendors, gpu.vendor, gpu.minVramMb)
        if slots is None:
            return None
        port = free_port(self.settings.host)
        name = f"{self.model.name}-{index}"
        child = Child(name, self._argv(port), self.settings.log_dir / f"{name}.log", self._env(port, slots))
        replica = Replica(index=index, port=port, child=child, gpu_owner=owner)
        self.replicas.append(replica)
        replica.task = asyncio.create_task(self._supervise(replica), name=f"replica-{name}")
        return replica

    async def _stop_replica(self, replica: Replica) -> None:
        self._stopping += 1
        try:
            # Supervision ends first, so no health probe can mark the replica ready again.
            if replica.task is not None:
                replica.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await replica.task
            was_ready = replica.state is ReplicaState.READY
            replica.state = ReplicaState.STOPPING
            if was_ready:
                self._changed()
                await asyncio.sleep(self.settings.unroute_delay)
            await replica.child.stop(self.settings.stop_grace)
        finally:
            self._stopping -= 1
            self.gpus.release(replica.gpu_owner)
        replica.state = ReplicaState.STOPPED
        log.info("replica stopped model=%s replica=%d", self.model.key, replica.index)

    def publish(self) -> None:
        """Routing-relevant state changed outside a replica (admission, failures)."""
        self._changed()

    def _changed(self) -> None:
        self.generation += 1
        self._on_change()

    async def _supervise(self, replica: Replica) -> None:
        backoff = self.settings.restart_backoff_min
        url = f"http://{self.settings.host}:{replica.port}{self.backend.health_path}"
        load_timeout = float(self.model.spec.scaling.activationTimeout)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while True:
                replica.state = ReplicaState.STARTING
                replica.started_at = time.monotonic()
                await replica.child.start()
                if self.on_spawned is not None:
                    self.on_spawned(self, replica)
                exited = asyncio.ensure_future(replica.child.wait())
                try:
                    code, reason = await self._watch(replica, session, url, exited, load_timeout)
                finally:
                    if not exited.done():
                        exited.cancel()
                was_ready = replica.ready_at is not None
                if was_ready:
                    backoff = self.settings.restart_backoff_min
                else:
                    self._activation_failed(
                        reason or f"backend exited with code {code} while loading (log: {replica.child.log_path})"
                    )
                replica.state = ReplicaState.RESTARTING
                replica.ready_at = None
                replica.restarts += 1
                if self.model.spec.scaling.min == 0:
                    # Scale-from-zero models do not restart on their own: the scaler decides
                    # again from demand, and a failed load needs a new activation lease.
                    log.warning(
                        "replica exited model=%s replica=%d code=%s log=%s",
                        self.model.key,
                        replica.index,
                        code,
                        replica.child.log_path,
                    )
                    replica.state = ReplicaState.STOPPED
                    self.gpus.release(replica.gpu_owner)
                    if replica in self.replicas:
                        self.replicas.remove(replica)
                    self._changed()
                    if self.on_exit is not None:
                        self.on_exit(self)
                    return
                self._changed()
                log.warning(
                    "replica exited model=%s replica=%d code=%s restart_in=%.1fs log=%s",
                    self.model.key,
                    replica.index,
                    code,
                    backoff,
                    replica.child.log_path,
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.settings.restart_backoff_max)

    def _activation_failed(self, reason: str) -> None:
        self.failed_activations += 1
        self.last_failure = reason
        log.warning("activation failed model=%s failures=%d reason=%s", self.model.key, self.failed_activations, reason)
        if self.on_activation_failed is not None:
            self.on_activation_failed(self, reason)

    async def _watch(
        self,
        replica: Replica,
        session: aiohttp.ClientSession,
        url: str,
        exited: asyncio.Future[int],
        load_timeout: float,
    ) -> tuple[int | None, str | None]:
        """Probe health until the process exits; returns its exit code and, for a load that
        never passed health in time, the reason it was stopped."""
        while not exited.done():
            if replica.ready_at is None and time.monotonic() - replica.started_at > load_timeout:
                await replica.child.stop(self.settings.stop_grace)
                return exited.result() if exited.done() else None, (
                    f"health check {self.backend.health_path} did not pass within {load_timeout:.0f}s"
                )
            healthy = await _probe(session, url)
            if healthy and replica.state is not ReplicaState.READY:
                replica.state = ReplicaState.READY
                replica.ready_at = time.monotonic()
                log.info(
                    "replica ready model=%s replica=%d port=%d load_seconds=%.2f",
                    self.model.key,
                    replica.index,
                    replica.port,
                    replica.ready_at - replica.started_at,
                )
                if self.on_ready is not None:
                    self.on_ready(self, replica)
                self._changed()
            elif not healthy and replica.state is ReplicaState.READY:
                replica.state = ReplicaState.STARTING
                log.warning("replica unhealthy model=%s replica=%d", self.model.key, replica.index)
                self._changed()
            interval = (
                self.settings.probe_interval_ready
                if replica.state is ReplicaState.READY
                else self.settings.probe_interval_loading
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(exited), interval)
        return exited.result(), None


async def _probe(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url) as response:
            return response.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False
