"""One replica of a model under `wakegate up` as the runtime keeps it: its state, its start
attempts (`Activation`), the model's idle tier, and the runtime's knobs.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from wakegate.control.backends import LoadSignals
from wakegate.control.local.children import Child
from wakegate.control.up.weights import Weights


def activation_margin(timeout: float) -> float:
    """How long before `activationTimeout` runs out an activation whose attempts all failed is
    given up: a held request's own timeout runs from its arrival, a moment before the start
    attempts began, and it should hear the last attempt's reason rather than a bare timeout."""
    return min(1.0, timeout / 10)


@dataclass
class Activation:
    """One replica's start attempts since it last began from nothing (or was last given up on)."""

    began: float
    deadline: float
    #: Attempts that failed so far, and why the last one did.
    failed: int = 0
    last_failure: str = ""


class ReplicaState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    STOPPED = "stopped"
    #: The asleep tier: the process lives, the engine has let go of the model (unrouted).
    SLEEPING = "sleeping"
    ASLEEP = "asleep"
    WAKING = "waking"


#: States of a replica whose process lives but whose model is not on the accelerator (or is
#: getting there): the tier's task drives them; the watch loop only notices the process exit.
DORMANT = frozenset({ReplicaState.SLEEPING, ReplicaState.ASLEEP, ReplicaState.WAKING})


class Tier(StrEnum):
    """How far a model has idled: warm (serving), asleep (process alive, accelerator freed), zero."""

    WARM = "warm"
    ASLEEP = "asleep"
    ZERO = "zero"


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
    #: Folder of engines' private state: one per model and replica slot (Ollama's model store).
    engines_dir: Path = Path(".wakegate/engines")
    #: Relative `file://` sources are found from here: the manifest's folder.
    base_dir: Path | None = None
    #: How often a ready replica's own load signals are read (for picking and draining).
    load_interval: float = 0.5


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
    #: Lowest number free among the model's replicas: names the engine's private folder, which
    #: outlives the process (Ollama's store is reused on the next wake).
    slot: int = 0
    #: Cold-start timeline of the current process (monotonic seconds).
    #: The weights were on disk (pulled, checked, staged) and the process about to start.
    weights_at: float | None = None
    healthy_at: float | None = None
    #: The plugin's load steps done (Ollama: the model created in its store).
    prepared_at: float | None = None
    loaded_at: float | None = None
    first_byte: float | None = None
    #: When that first byte came (monotonic), for the timeline.
    first_byte_at: float | None = None
    #: The engine's own load signals, last read.
    load: LoadSignals | None = None
    #: The first answer asked of a new process (runs beside the first requests).
    probe: asyncio.Task[None] | None = None
    #: The weights the current process loads, leased until it exits.
    weights: Weights | None = None
    #: Its LoRAAdapters' weights (llama.cpp: all of the base's, given at start), leased likewise.
    #: Engines that load adapters at run time get them from the model's HotSwap instead.
    adapter_weights: list[Weights] = field(default_factory=list)
    #: The start attempts of its current activation (None once it is ready).
    activation: Activation | None = None
    #: When it last went to sleep (monotonic), while it sleeps.
    asleep_since: float | None = None
