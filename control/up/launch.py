"""How a replica's engine process is started under `wakegate up`: its weights and LoRAAdapters
(leased through the cache for the life of the process), its arguments and its environment.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wakegate.control.backends.base import Backend, fill, kv_events_argv
from wakegate.control.delivery.errors import DeliveryError
from wakegate.control.schema import Model
from wakegate.control.up.gpus import Slot, visible_devices_env
from wakegate.control.up.hotswap import HotSwap
from wakegate.control.up.replica import Replica, ReplicaState, RuntimeSettings
from wakegate.control.up.weights import Delivery, Weights, WeightsWatch


class ReplicaLaunch:
    """What one model's replicas are started with (a part of `ModelRuntime`, runtime.py, which
    holds the state)."""

    if TYPE_CHECKING:
        model: Model
        backend: Backend
        settings: RuntimeSettings
        replicas: list[Replica]
        delivery: Delivery
        weights: Path | None
        weights_watch: WeightsWatch
        adapter_watches: Mapping[str, WeightsWatch]
        adapter_loaded_at: dict[str, float]
        hotswap: HotSwap | None
        can_sleep: bool

    def _values(self, replica: Replica) -> dict[str, str]:
        """What the plugin's templates are filled with for one replica."""
        state = self.settings.engines_dir / self.model.name / str(replica.slot)
        weights = replica.weights.path if replica.weights is not None else self.weights
        return {
            "host": self.settings.host,
            "port": str(replica.port),
            # The engine gets the weights: the file (or folder) the source resolved to; without a
            # source, the served name (a hub id vLLM fetches itself).
            "model": str(weights) if weights is not None else self.model.served_name,
            "served_name": self.model.served_name,
            "state": str(state.resolve()),
            "max_adapters": str(self.model.spec.adapters.maxAdapters),
            "sleep_level": str(self.model.spec.scaling.sleepLevel),
        }

    def _argv(self, values: dict[str, str], adapters: Sequence[Weights] = ()) -> list[str]:
        argv = self.backend.command(values, tuple(self.model.spec.command)) + list(self.model.spec.args)
        if adapters and self.backend.lora_arg:
            argv += list(self.backend.lora_start_args)
            for weights in adapters:
                argv += [self.backend.lora_arg, str(weights.path)]
        elif self.model.adapters and self.backend.lora_runtime_args:
            argv += [fill(a, values) for a in self.backend.lora_runtime_args]
        if self.can_sleep:
            argv += [a for a in self.backend.sleep_args if a not in argv]
        kv = self.model.spec.routing.kvEvents
        if kv is not None:
            argv += kv_events_argv(self.backend, argv, int(values["port"]), kv.portOffset, kv.replayPortOffset)
        return argv

    def _env(self, values: dict[str, str], gpus: list[Slot]) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.backend.environment(values))
        env.update(visible_devices_env(gpus))
        if self.model.adapters:
            env.update(self.backend.lora_runtime_env)
        if self.can_sleep:
            env.update(self.backend.sleep_env)
        env.update(self.model.spec.env)
        return env

    async def _acquire_adapters(self, replica: Replica) -> None:
        """The base's LoRAAdapters, through the cache, for an engine that loads every one at start
        (llama.cpp), so that a first request for one never restarts the base. Engines that load
        them at run time get them from the HotSwap, on demand."""
        if not self.backend.lora_arg:
            return
        try:
            for adapter in self.model.adapters:
                watch = self.adapter_watches[adapter.name]
                weights = await self.delivery.acquire_adapter(adapter, watch, base_dir=self.settings.base_dir)
                replica.adapter_weights.append(weights)
        except DeliveryError as exc:
            self._release_weights(replica)
            raise DeliveryError(f"LoRAAdapter {adapter.name}: {exc}", exc.reason) from None

    def adapter_status(self) -> dict[str, dict[str, Any]]:
        """Per LoRAAdapter: the replicas that hold it, when it was last loaded, its weights' state."""
        ready = [r for r in self.replicas if r.state is ReplicaState.READY]
        if self.hotswap is not None:
            names = {f"{self.settings.host}:{r.port}": f"{self.model.name}-{r.index}" for r in ready}
            return self.hotswap.status(names)
        out: dict[str, dict[str, Any]] = {}
        for adapter in self.model.adapters:
            watch = self.adapter_watches[adapter.name]
            loaded_at = self.adapter_loaded_at.get(adapter.name)
            weights = watch.status()
            holders = [] if watch.error is not None else [f"{self.model.name}-{r.index}" for r in ready]
            out[adapter.name] = {
                "base": self.model.name,
                "served_name": adapter.served_name,
                "source": adapter.spec.source,
                "replicas": holders,
                "loaded_replicas": len(holders),
                "last_load": None if loaded_at is None else time.strftime(
                    "%Y-%m-%dT%H:%M:%SZ", time.gmtime(loaded_at)),
                "failure": weights["error"],
                "weights": weights,
            }
        return out

    async def _acquire_weights(self, replica: Replica, deadline: float) -> None:
        """`spec.source` to a local path for this start of the replica's engine, leased (relative
        file:// from the manifest's folder; oci:// and hf:// through the cache, checked). The
        weights must be there by the activation's `deadline` (its time less a margin), so that held
        requests learn why before their own timeout; a pull cut short keeps its bytes for the next try."""
        if self.model.spec.source is None:
            return
        timeout = float(self.model.spec.scaling.activationTimeout)
        budget = max(0.1, deadline - time.monotonic())
        acquire = self.delivery.acquire(
            self.model, self.weights_watch, base_dir=self.settings.base_dir, needs_file=self.backend.needs_file,
            folder=self.backend.loads_folder,
        )
        try:
            replica.weights = await asyncio.wait_for(acquire, budget)
        except TimeoutError:
            error = DeliveryError(
                f"{self.model.spec.source}: the weights were not ready within {budget:.0f}s of the "
                f"{timeout:.0f}s activationTimeout (bytes pulled so far are kept for the next activation)",
                "timeout",
            )
            self.weights_watch.failed(error)
            raise error from None
        self.weights = replica.weights.path

    def _release_weights(self, replica: Replica) -> None:
        if replica.weights is not None:
            replica.weights.release()
            replica.weights = None
        for weights in replica.adapter_weights:
            weights.release()
        replica.adapter_weights.clear()
        if self.hotswap is not None:
            self.hotswap.forget(f"{self.settings.host}:{replica.port}")

