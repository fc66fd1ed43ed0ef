"""When the scaling core is evaluated, and who hears the verdicts.

:class:`Hub` evaluates the pure :class:`~wakegate.control.scaling.core.Core` on the next
loop turn after a demand change (coalescing bursts) and at the earliest time a decision
said it could change, and fans the result out to StreamIsActive watchers and any other
listener (the builtin engine of `wakegate scaler`). A ScaledObjectRef names a Model by
``scalerMetadata.model`` (``name`` or ``namespace/name``), else by its own name
(``wg-<model>`` or ``<model>``) in its namespace.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from wakegate.control.k8s.names import backend_name
from wakegate.control.scaling.core import Core, Verdict
from wakegate.externalscaler import externalscaler_pb2

#: Pending state changes kept per stream; older ones are dropped when KEDA reads slower than they come.
_STREAM_BACKLOG = 8

VerdictListener = Callable[[dict[str, Verdict]], None]


@dataclass(eq=False)
class _Watcher:
    key: str
    pending: list[bool] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def push(self, active: bool) -> None:
        if self.pending and self.pending[-1] == active:
            return
        self.pending.append(active)
        del self.pending[:-_STREAM_BACKLOG]
        self.wake.set()


class Hub:
    def __init__(
        self,
        core: Core,
        *,
        clock: Callable[[], float] = time.monotonic,
        live: Callable[[], Mapping[str, int] | None] = lambda: None,
    ) -> None:
        self.core = core
        self._clock = clock
        self._live = live
        self._listeners: list[VerdictListener] = []
        self._watchers: set[_Watcher] = set()
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self.evaluations = 0

    def add_listener(self, listener: VerdictListener) -> None:
        self._listeners.append(listener)

    @property
    def streams(self) -> int:
        return len(self._watchers)

    def poke(self) -> None:
        """Demand or the model set changed: evaluate on the next loop turn."""
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.evaluate)

    def evaluate(self) -> None:
        self._scheduled = False
        before = self.core.verdicts
        verdicts, next_at = self.core.evaluate(self._clock(), self._live())
        self.evaluations += 1
        for watcher in self._watchers:
            old, new = before.get(watcher.key), verdicts.get(watcher.key)
            if new is None:
                continue
            # Every rise of demand sends `true` again: KEDA scales 0->1 on each `true` it receives.
            if old is None or old.active != new.active or (new.busy and not old.busy):
                watcher.push(new.active)
        for listener in self._listeners:
            listener(verdicts)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if next_at is not None:
            delay = max(0.0, next_at - self._clock())
            self._timer = asyncio.get_running_loop().call_later(delay, self.poke)

    def resolve(self, ref: externalscaler_pb2.ScaledObjectRef) -> str | None:
        """The model key a ScaledObjectRef names, or None when no served model matches."""
        namespace = ref.namespace
        candidates: list[str] = []
        named = ref.scalerMetadata.get("model", "")
        if named:
            candidates += [named] if "/" in named else [f"{namespace}/{named}", named]
        else:
            prefix = backend_name("")
            names = [ref.name[len(prefix) :]] if ref.name.startswith(prefix) else []
            for name in [*names, ref.name]:
                candidates += [f"{namespace}/{name}", name]
        return next((key for key in candidates if key in self.core.models), None)

    def watch(self, key: str) -> _Watcher:
        watcher = _Watcher(key)
        self._watchers.add(watcher)
        return watcher

    def unwatch(self, watcher: _Watcher) -> None:
        self._watchers.discard(watcher)
