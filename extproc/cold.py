"""Cold requests: bounded per-model queues, activation leases, and the wake-up when a model is ready.

A request for a model with no ready endpoint first registers demand (it starts
or joins the model's activation lease), then waits here until the route table
shows an endpoint, the activation fails, or its own activation timeout passes.
Waiting is a future per model resolved by route pushes from the feeder: no
polling. A cancelled waiter (client gone) frees its queue slot at once.

The lease lives independently of the requests: it begins with the first cold
request, keeps the model demanded while it loads even if every client left,
and ends at readiness plus a short grace, at the activation timeout, or when
the feeder reports the activation failed.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from wakegate import contract
from wakegate.v1 import routing_pb2

log = logging.getLogger("wakegate.extproc.cold")

#: How long a lease outlives readiness, so the scaler sees demand until the
#: flushed requests show up as in-flight.
LEASE_GRACE_SECONDS = 5.0


class QueueFull(Exception):
    pass


class ActivationFailed(Exception):
    """The activation the request waited for failed; `code` is the error code its answer carries."""

    def __init__(self, message: str, failure_code: str = "") -> None:
        super().__init__(message)
        self.failure_code = failure_code

    @property
    def code(self) -> str:
        weights = self.failure_code == contract.WEIGHTS_UNAVAILABLE
        return contract.WEIGHTS_UNAVAILABLE if weights else "activation_failed"

    def answer(self, model: str) -> str:
        """The message a held request of `model` gets."""
        if self.code == contract.WEIGHTS_UNAVAILABLE:
            return f"model {model!r} cannot get its weights: {self}"
        return f"model {model!r} failed to start: {self}"


class ActivationTimeout(Exception):
    pass


@dataclass
class Lease:
    started: float
    deadline: float
    failures_seen: int
    ready_at: float | None = None
    #: The demand report carrying this lease reached the scaler (activation signal timed).
    signalled: bool = False
    #: A held request was sent on after readiness (first byte timed).
    flushed: bool = False

    def live(self, now: float) -> bool:
        if self.ready_at is not None:
            return now < self.ready_at + LEASE_GRACE_SECONDS
        return now < self.deadline


@dataclass
class ModelQueue:
    key: str
    waiting: int = 0
    lease: Lease | None = None
    ready: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    failures_seen: int = 0
    started_activations: int = 0
    #: Bumped when the held requests are failed: they are no longer counted (`waiting` starts
    #: again from 0), though each leaves `wait` only when its task next runs.
    generation: int = 0


class ColdQueues:
    """All cold-path state of one gateway process."""

    def __init__(
        self,
        on_demand_change: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
        on_failure: Callable[[str, ActivationFailed], None] = lambda key, failure: None,
    ) -> None:
        self._models: dict[str, ModelQueue] = {}
        self._on_demand_change = on_demand_change
        self._clock = clock
        #: An activation failed (requests held for the model elsewhere, by flow control, get it too).
        self._on_failure = on_failure
        self._release = ReleaseGate()

    def queue(self, key: str) -> ModelQueue:
        queue = self._models.get(key)
        if queue is None:
            queue = self._models[key] = ModelQueue(key)
        return queue

    def depth(self, key: str) -> int:
        queue = self._models.get(key)
        return queue.waiting if queue else 0

    def snapshot(self) -> dict[str, tuple[int, int, int]]:
        """key -> (queued, live leases, failures seen) for demand reports."""
        now = self._clock()
        out = {}
        for key, queue in self._models.items():
            lease = 1 if queue.lease is not None and queue.lease.live(now) else 0
            if queue.waiting or lease:
                out[key] = (queue.waiting, lease, queue.lease.failures_seen if queue.lease else queue.failures_seen)
        return out

    def demand(self, route: routing_pb2.ModelRoute) -> None:
        """Count a cold request as demand: start the model's lease if none is live."""
        queue = self.queue(route.key)
        now = self._clock()
        if queue.lease is None or not queue.lease.live(now):
            # Failures before this lease are not news to it, even for a queue that never saw
            # them (the standby's first request for a model that failed while the active served).
            queue.failures_seen = max(queue.failures_seen, route.failed_activations)
            queue.lease = Lease(
                started=now,
                deadline=now + route.cold.activation_timeout_ms / 1000,
                failures_seen=route.failed_activations,
            )
            queue.started_activations += 1
            log.info(
                "activation lease started model=%s timeout_s=%.0f", route.key, route.cold.activation_timeout_ms / 1000
            )
            self._on_demand_change()

    def join(self, route: routing_pb2.ModelRoute) -> ModelQueue:
        """Count one more request held for `route`'s model (QueueFull past its `maxQueue`). It waits
        for the queue's `ready` future of now, and leaves with `left(queue, generation of now)`."""
        queue = self.queue(route.key)
        if queue.waiting >= route.cold.max_queue:
            raise QueueFull(route.key)
        queue.waiting += 1
        self._on_demand_change()
        return queue

    def left(self, queue: ModelQueue, generation: int, count: int = 1) -> None:
        """`count` requests that joined in `generation` stopped waiting (a failure already let go
        of every request of its generation)."""
        if queue.generation == generation:
            queue.waiting -= count
            self._on_demand_change()

    async def wait(self, route: routing_pb2.ModelRoute, deadline: float) -> None:
        """Hold one request until its model is ready; raise QueueFull, ActivationFailed or ActivationTimeout."""
        queue = self.join(route)
        generation = queue.generation
        try:
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise ActivationTimeout(route.key)
            try:
                await asyncio.wait_for(asyncio.shield(queue.ready), remaining)
            except TimeoutError:
                raise ActivationTimeout(route.key) from None
        finally:
            self.left(queue, generation)
        await self._release.turn()

    def on_routes(self, routes: dict[str, routing_pb2.ModelRoute]) -> None:
        """Wake waiters of models that became ready; fail those whose activation failed."""
        now = self._clock()
        for key, queue in list(self._models.items()):
            route = routes.get(key)
            if route is None:
                self._fail(queue, f"model {key!r} was removed")
                del self._models[key]
                continue
            if route.failed_activations > queue.failures_seen:
                queue.failures_seen = route.failed_activations
                if queue.lease is not None:
                    queue.lease = None
                self._fail(queue, route.last_failure or "model failed to start", route.failure_code)
            elif route.endpoints:
                if queue.lease is not None and queue.lease.ready_at is None:
                    queue.lease.ready_at = now
                    log.info(
                        "model ready model=%s held=%d waited_s=%.3f", key, queue.waiting, now - queue.lease.started
                    )
                if not queue.ready.done():
                    queue.ready.set_result(None)
            elif queue.ready.done():
                # Cold again (scaled to zero, swapped out): the old activation is over, and
                # the next cold request starts a new lease.
                queue.ready = asyncio.get_running_loop().create_future()
                queue.lease = None
        self._on_demand_change()

    def _fail(self, queue: ModelQueue, message: str, failure_code: str = "") -> None:
        failed = ActivationFailed(message, failure_code)
        if not queue.ready.done():
            queue.ready.set_exception(failed)
            queue.ready.exception()  # retrieved here: waiters may all be gone
        queue.ready = asyncio.get_running_loop().create_future()
        # The failed requests stop counting now, not when their tasks get to run: a demand report
        # sent in between would show them held with no lease (no longer tied to the failure it
        # was part of) and start a new activation that nobody waits for.
        held, queue.waiting = queue.waiting, 0
        queue.generation += 1
        self._on_failure(queue.key, failed)
        log.warning("activation failed model=%s held=%d code=%s reason=%s", queue.key, held, failed.code, message)

    def delivered(self) -> list[tuple[str, float]]:
        """Leases whose demand report just reached the scaler: (model, seconds since lease start)."""
        now = self._clock()
        out = []
        for key, queue in self._models.items():
            if queue.lease is not None and not queue.lease.signalled:
                queue.lease.signalled = True
                out.append((key, now - queue.lease.started))
        return out

    def flushed(self, key: str) -> float | None:
        """The first held request of the current activation went on: seconds since lease start."""
        queue = self._models.get(key)
        if queue is None or queue.lease is None or queue.lease.flushed:
            return None
        queue.lease.flushed = True
        return self._clock() - queue.lease.started

    def expire(self) -> float | None:
        """Drop leases that ended; returns seconds until the next lease ends (None if none)."""
        now = self._clock()
        soonest: float | None = None
        changed = False
        for queue in self._models.values():
            lease = queue.lease
            if lease is None:
                continue
            if not lease.live(now):
                queue.lease = None
                changed = True
                continue
            end = lease.ready_at + LEASE_GRACE_SECONDS if lease.ready_at is not None else lease.deadline
            soonest = end - now if soonest is None else min(soonest, end - now)
        if changed:
            self._on_demand_change()
        return soonest


class ReleaseGate:
    """Lets at most `batch` woken requests go on per turn of the event loop.

    A model that becomes ready wakes every request held for it at once. Routing 10,000 of them
    in one turn kept extproc's loop from its sockets for longer than Envoy's keepalive check
    (0.75 s): Envoy then took extproc for stalled and replayed ~8,000 streams, which reached
    the model server all at once (bench_cold --held 10000 --held-h2 100: 803 answered 503).
    Past the batch, a request waits for a later turn, in the order it came; the loop reads its
    sockets (keepalive pings among them) between turns. Up to `batch` requests pay nothing."""

    def __init__(self, batch: int = 128) -> None:
        self.batch = batch
        self._used = 0
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._scheduled = False

    async def turn(self) -> None:
        if self._used < self.batch and not self._waiting:
            self._used += 1
            self._schedule()
            return
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(future)
        self._schedule()
        await future

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._next_turn)

    def _next_turn(self) -> None:
        self._scheduled = False
        self._used = 0
        while self._waiting and self._used < self.batch:
            future = self._waiting.popleft()
            if not future.done():
                future.set_result(None)
                self._used += 1
        if self._used or self._waiting:
            self._schedule()
