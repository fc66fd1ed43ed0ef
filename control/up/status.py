"""What `wakegate up` reports of itself: /status, /savings and the live status table."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from wakegate.control.feeder.native import routing_path
from wakegate.control.feeder.settings import GatewaySettings
from wakegate.control.local.children import Supervised
from wakegate.control.scaling.savings import Ledger
from wakegate.control.up.gpus import GpuPool
from wakegate.control.up.predictive import Predictive
from wakegate.control.up.replica import ReplicaState, Tier
from wakegate.control.up.runtime import ModelRuntime
from wakegate.control.up.scaler import LocalScaler
from wakegate.control.up.weights import Delivery


def _model_state(runtime: ModelRuntime) -> str:
    """One word for the status table: idle, waiting (GPU group), loading, ready, restarting."""
    states = {r.state for r in runtime.replicas}
    if ReplicaState.READY in states:
        return "ready"
    if ReplicaState.WAKING in states:
        return "waking"
    if states and states <= {ReplicaState.ASLEEP, ReplicaState.SLEEPING}:
        return "asleep"
    if ReplicaState.STARTING in states:
        return "loading"
    if ReplicaState.RESTARTING in states:
        return "restarting"
    if not runtime.admitted or runtime.waiting_for:
        return "waiting"
    return "idle"


def _weights_cell(progress: dict[str, Any] | None) -> str:
    """The status table's weights column: the phase, and how far a transfer is."""
    if progress is None:
        return "-"
    total = progress["total_bytes"]
    if progress["phase"] in ("pulling", "waiting", "verifying", "staging") and total:
        return f"{progress['phase']} {100 * progress['done_bytes'] // total}%"
    return str(progress["phase"])


class UpStatus:
    """`wakegate up`'s reports (a part of `Up`, supervisor.py, which holds the state)."""

    if TYPE_CHECKING:
        gateway: GatewaySettings
        serving: bool
        components: dict[str, Supervised]
        runtimes: dict[str, ModelRuntime]
        gpus: GpuPool
        predictive: Predictive
        scaler: LocalScaler
        started_at: float
        delivery: Delivery
        ledger: Ledger

    async def _status_display(self) -> None:
        from rich.console import Console
        from rich.live import Live
        from rich.table import Table

        def table() -> Table:
            view = Table(title=f"wakegate up — http://{self.gateway.listen_host}:{self.gateway.listen_port}")
            columns = ("model", "state", "replicas", "ready", "queued", "in-flight", "last cold start", "weights")
            for column in columns:
                view.add_column(column)
            for model in self.status()["models"]:
                cold = model["last_cold_start_seconds"]
                progress = (model["delivery"] or {}).get("progress")
                view.add_row(
                    model["key"],
                    model["state"],
                    str(len(model["replicas"])),
                    str(model["ready"]),
                    str(model["queued"]),
                    str(model["in_flight"]),
                    f"{cold:.2f}s" if cold else "-",
                    _weights_cell(progress),
                )
            return view

        with Live(table(), console=Console(stderr=True), refresh_per_second=2, transient=False) as live:
            while True:
                await asyncio.sleep(0.5)
                live.update(table())

    def _routing_path(self, runtime: ModelRuntime) -> dict[str, str]:
        """Which path the model's warm requests take now, and why not native when they cannot."""
        return routing_path(runtime.routed(), self.gateway)

    def status(self) -> dict[str, Any]:
        return {
            "gateway": f"http://{self.gateway.listen_host}:{self.gateway.listen_port}",
            "serving": self.serving,
            "components": {
                name: {
                    "pid": c.child.pid,
                    "running": c.child.running,
                    "restarts": c.restarts,
                    "log": str(c.child.log_path),
                }
                for name, c in self.components.items()
            },
            "models": [
                {
                    "key": rt.model.key,
                    "names": rt.model.client_names,
                    "served_name": rt.model.served_name,
                    "backend": rt.model.spec.backend,
                    "weights": str(rt.weights) if rt.weights is not None else None,
                    "delivery": rt.weights_watch.status() if rt.model.spec.source is not None else None,
                    "replicas": [
                        {
                            "index": r.index,
                            "port": r.port,
                            "state": r.state.value,
                            "pid": r.child.pid,
                            "restarts": r.restarts,
                            # The start attempts of an activation still in progress: how many
                            # failed, and the seconds it has left before it is given up.
                            "activation": (
                                {
                                    "failed_attempts": r.activation.failed,
                                    "seconds_left": round(max(0.0, r.activation.deadline - time.monotonic()), 1),
                                }
                                if r.activation is not None
                                else None
                            ),
                            "engine_load": (
                                {"running": r.load.running, "waiting": r.load.waiting, "kv_usage": r.load.kv_usage}
                                if r.load is not None
                                else None
                            ),
                            "gpus": self.gpus.owned(r.gpu_owner),
                            "log": str(r.child.log_path),
                        }
                        for r in rt.replicas
                    ],
                    "ready": len(rt.ready_endpoints),
                    "state": _model_state(rt),
                    "tier": rt.tier.value,
                    "sleep": {
                        "after_seconds": rt.model.spec.scaling.sleepAfter,
                        "level": rt.model.spec.scaling.sleepLevel,
                        "engine_can_sleep": rt.backend.can_sleep,
                        "skipped": rt.sleep_refused or None,
                    },
                    "predictive": self.predictive.status(rt.model.key),
                    "last_wake_seconds": {
                        Tier.ASLEEP.value: rt.last_wake_from_asleep,
                        Tier.ZERO.value: rt.last_cold_start,
                    },
                    **self._routing_path(rt),
                    "admitted": rt.admitted,
                    "waiting_for": rt.waiting_for,
                    "failed_activations": rt.failed_activations,
                    "last_failure": rt.last_failure,
                    "last_failure_code": rt.last_failure_code,
                    "failed_start_attempts": rt.failed_attempts,
                    "last_attempt_failure": rt.last_attempt_failure,
                    "last_cold_start_seconds": rt.last_cold_start,
                    "last_cold_start": dict(rt.last_timeline),
                    "queued": self.scaler.loads[rt.model.key].queued if rt.model.key in self.scaler.loads else 0,
                    "in_flight": (
                        self.scaler.loads[rt.model.key].in_flight if rt.model.key in self.scaler.loads else 0
                    ),
                    "leases": self.scaler.loads[rt.model.key].leases if rt.model.key in self.scaler.loads else 0,
                    "adapters": rt.adapter_status(),
                    "adapter_loads": rt.hotswap.load_summary() if rt.hotswap is not None else None,
                }
                for rt in self.runtimes.values()
            ],
            "savings": self.savings(self.started_at, time.time()),
            "cache": {"dir": str(self.delivery.config.cache_dir), "max_bytes": self.delivery.config.max_size},
            "gpu_groups": {
                name: {"active": self.scaler.group_active(name), "swaps": swaps}
                for name, swaps in self.scaler.swaps.items()
            },
        }

    def savings(self, since: float, until: float) -> dict[str, Any]:
        """Accelerator-seconds per tier and wakes per model in [since, until] (wall clock)."""
        return {"since": since, "until": until, "models": self.ledger.window(since, until)}

