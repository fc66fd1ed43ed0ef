"""Flow control: admission of requests to saturated models, fair between tenants and strict by band.

A model with `flowControl.enabled` is admitted here before it is picked. While it has room (some
replica not saturated) and nobody waits, a request goes on at once: one dict lookup and one
headroom sum over the model's endpoints. Otherwise it waits in one queue per (tenant, band):

- bands are strict: a request of a higher band is always dispatched before any lower one;
- within a band, tenants share by weighted deficit round robin (each visit gives a tenant its
  weight in credit, each dispatched request costs one); a tenant that had nothing held goes to
  the front of the round (as fq_codel's new flows do), so a tenant within its share waits for
  one free slot rather than for a turn of every other tenant;
- a reserve: while a sparse flow (a tenant that came with nothing of its own held while others
  had requests held) came in the last RESERVE_SECONDS, the backlogged flows leave one slot in
  RESERVE_EVERY of each endpoint's capacity free, and a sparse flow's request takes it at once
  (of the highest band holding any: a lower band never overtakes a higher one); so a tenant within
  its share, or a higher band's first request, does not wait for the next request to finish;
- the model's queue holds `max_queue` requests: when it is full, a request of a higher band takes
  the place of the newest request of the lowest band (which gets 503 `shed`: the model cannot take
  it); within the same band, the tenant holding the most per weight loses its newest (429
  `over_share` with Retry-After: that tenant is over its share), unless it is the only tenant
  waiting (503 `model_saturated`); a request below every held one gets 503 `model_saturated`;
- a request held longer than `queue_timeout_ms` gets 503 `queue_timeout`.

Saturation, per endpoint, from the engine's own signals (extproc/engines.py, read every 0.5 s)
and this gateway's in-flight count: an engine that reported requests waiting told us how many it
runs at once (its `cap`); its load now is this gateway's in-flight count (which includes what it
routed that has not reached the engine yet) plus what other gateways had there at the reading
(the reading's running and waiting less this gateway's count then). A request the engine finished
is so counted once: a reading taken after its end and the gateway's count going down when its
access-log entry comes would otherwise each free its slot, and the engine's own queue would fill
behind the gateway's back. An endpoint has room while that load leaves fewer than `max_waiting`
requests waiting in the engine (load < cap + max_waiting), while its KV-cache usage is under
`max_kv_usage` (at or over it: only as many as finished since the reading), and while this
gateway has fewer than `max_in_flight` requests on it. An engine that never queued has no known
cap: it is not saturated until it reports waiting. Dispatch is driven by the events that free
room: a request finishing (its access-log entry), a new engine reading, a route change.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from wakegate.contract import BANDS
from wakegate.extproc.scheduling import EngineState
from wakegate.v1 import routing_pb2

#: The tenant of requests that name none (no key tenant, no allowed fairness header).
DEFAULT_TENANT = "default"
BAND_RANK = {band: rank for rank, band in enumerate(BANDS)}
#: Distinct tenants named in metric labels; others are counted as "other" (header tenants are
#: the clients' choice).
MAX_TENANT_LABELS = 100
_UNLIMITED = 1 << 30
#: While the model holds requests, flows with a backlog leave one slot in RESERVE_EVERY of each
#: endpoint's capacity free (at most MAX_RESERVE) for sparse flows; kept for RESERVE_SECONDS
#: after a sparse flow last came while others were held.
RESERVE_EVERY = 12
MAX_RESERVE = 4
RESERVE_SECONDS = 5.0


class Shed(Exception):
    """A request flow control refuses: its status, error code and message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(eq=False, slots=True)
class Ticket:
    """One held request."""

    tenant: str
    band: int
    weight: float
    enqueued: float
    future: asyncio.Future[None]
    #: Dispatched (its future resolved) and not yet routed.
    granted: bool = False
    #: Its tenant had nothing held in its band when it came while others had (a sparse flow,
    #: within its share), so it may take the reserve.
    sparse: bool = False
    #: It came while the model had no endpoint (held while the model wakes: see `wait`).
    cold: bool = False
    #: Cold, and the model has had no endpoint since: its deadline is the activation timeout's.
    waking: bool = False
    #: When it stops waiting (set by `wait`, moved on when its model turns ready).
    deadline: float = 0.0


@dataclass(slots=True)
class _Band:
    """The queues of one band of one model: per tenant, in deficit round robin."""

    queues: dict[str, deque[Ticket]] = field(default_factory=dict)
    #: Tenants with queued requests, in visiting order; the head is being served.
    active: deque[str] = field(default_factory=deque)
    deficit: dict[str, float] = field(default_factory=dict)
    size: int = 0

    def push(self, ticket: Ticket) -> bool:
        """Queue the ticket; True if its tenant had nothing held in this band."""
        queue = self.queues.get(ticket.tenant)
        if queue is None:
            # A tenant with nothing held is served next (its quantum, then to the back of the line):
            # one that sends within its share waits for one free slot, not for a round of the others.
            queue = self.queues[ticket.tenant] = deque()
            self.active.appendleft(ticket.tenant)
            self.deficit[ticket.tenant] = 0.0
            queue.append(ticket)
            self.size += 1
            return True
        queue.append(ticket)
        self.size += 1
        return False

    def pop_sparse(self) -> Ticket | None:
        """The first request of a sparse flow (one that came with nothing of its tenant held), if any."""
        for tenant in self.active:
            queue = self.queues[tenant]
            if queue[0].sparse:
                ticket = queue.popleft()
                self.size -= 1
                if not queue:
                    self._drop(tenant)
                return ticket
        return None

    def pop(self) -> Ticket:
        """The next request by weighted deficit round robin (the band must not be empty)."""
        while True:
            tenant = self.active[0]
            queue = self.queues[tenant]
            if self.deficit[tenant] < 1:
                self.deficit[tenant] += queue[0].weight
                if self.deficit[tenant] < 1:
                    self.active.rotate(-1)
                    continue
            ticket = queue.popleft()
            self.size -= 1
            self.deficit[tenant] -= 1
            if not queue:
                self._drop(tenant)
            elif self.deficit[tenant] < 1:
                self.active.rotate(-1)
            return ticket

    def remove(self, ticket: Ticket) -> bool:
        queue = self.queues.get(ticket.tenant)
        if queue is None:
            return False
        try:
            queue.remove(ticket)
        except ValueError:
            return False
        self.size -= 1
        if not queue:
            self._drop(ticket.tenant)
        return True

    def _drop(self, tenant: str) -> None:
        del self.queues[tenant]
        del self.deficit[tenant]
        self.active.remove(tenant)

    def heaviest(self, extra: Ticket | None = None) -> str:
        """The tenant holding the most requests per weight (counting `extra` as queued); ties: the
        tenant of `extra`, else the one first in line."""

        def load(tenant: str) -> float:
            queue = self.queues.get(tenant)
            held = len(queue) if queue else 0
            weight = queue[0].weight if queue else extra.weight if extra else 1.0
            return (held + (1 if extra is not None and extra.tenant == tenant else 0)) / weight

        candidates = ([extra.tenant] if extra is not None else []) + list(self.active)
        return max(candidates, key=load)


@dataclass(slots=True)
class _ModelFlow:
    route: routing_pb2.ModelRoute
    bands: list[_Band] = field(default_factory=lambda: [_Band() for _ in BANDS])
    size: int = 0
    granted: int = 0
    #: When a sparse flow last came while others were held: the reserve is kept until RESERVE_SECONDS later.
    contended_at: float = float("-inf")
    #: Some held request came while the model had no endpoint and it has had none since.
    waking: bool = False

    def tickets(self) -> list[Ticket]:
        return [ticket for band in self.bands for queue in band.queues.values() for ticket in queue]

    def pop(self) -> Ticket:
        for band in self.bands:
            if band.size:
                self.size -= 1
                return band.pop()
        raise IndexError("empty")

    def pop_sparse(self) -> Ticket | None:
        """A sparse flow's request of the highest band holding any (none of a lower band overtakes)."""
        for band in self.bands:
            if band.size:
                ticket = band.pop_sparse()
                if ticket is not None:
                    self.size -= 1
                return ticket
        return None


class FlowControl:
    """The admission queues of one extproc process, for every model with flow control."""

    def __init__(
        self,
        engines: Mapping[str, EngineState],
        inflight: Callable[[str], int],
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[str, str, str, int], None] = lambda model, tenant, band, delta: None,
    ) -> None:
        self._engines = engines
        self._inflight = inflight
        self._clock = clock
        #: (model, tenant label, band, +1/-1) whenever a request joins or leaves a queue (metrics).
        self._on_change = on_change
        self._models: dict[str, _ModelFlow] = {}
        #: endpoint -> requests its engine runs at once, learnt from a reading with some waiting
        self.caps: dict[str, int] = {}
        self._labels: set[str] = set()

    # -- saturation -------------------------------------------------------------------------------

    def headroom(self, route: routing_pb2.ModelRoute) -> tuple[int, int]:
        """Requests the model's endpoints can take now before any is saturated: all requests, and
        those of flows with a backlog (which leave each endpoint's reserve free)."""
        flow = route.flow
        total = bulk = 0
        for e in route.endpoints:
            room, reserve = self._room(f"{e.address}:{e.port}", flow)
            if room >= _UNLIMITED:
                return _UNLIMITED, _UNLIMITED
            total += max(0, room)
            bulk += max(0, room - reserve)
        return total, bulk

    def _room(self, endpoint: str, flow: routing_pb2.FlowControl) -> tuple[int, int]:
        """Requests the endpoint can take now, and how many of those are its reserve."""
        own = self._inflight(endpoint)
        limit = flow.max_in_flight or _UNLIMITED
        room = limit - own
        state = self._engines.get(endpoint)
        if state is not None:
            if flow.max_kv_usage and state.kv_usage is not None and state.kv_usage >= flow.max_kv_usage:
                room = min(room, int(state.own) - own)  # only as many as finished since the reading
            cap = self.caps.get(endpoint)
            if flow.max_waiting and state.waiting is not None and cap is not None:
                # Other gateways' requests at the reading, plus all of this one's now: this one's count
                # includes what it routed that has not reached the engine yet, and never counts a
                # request the engine finished twice (as the reading and the count both would).
                others = int(state.running or 0) + int(state.waiting) - int(state.own)
                load = own + max(0, others)
                fits = cap + flow.max_waiting - 1  # fewer than max_waiting left waiting in the engine
                room = min(room, fits - load)
                limit = min(limit, fits)
        return room, (min(MAX_RESERVE, limit // RESERVE_EVERY) if limit < _UNLIMITED else 0)

    def engines_read(self) -> None:
        """A round of engine readings is in: learn caps, then dispatch what now fits."""
        for endpoint, state in self._engines.items():
            if state.waiting and state.running:
                self.caps[endpoint] = int(state.running)
        for endpoint in [ep for ep in self.caps if ep not in self._engines]:
            del self.caps[endpoint]
        self.kick_all()

    # -- admission ------------------------------------------------------------------------------

    def label(self, tenant: str) -> str:
        """`tenant` as a metric label: the first MAX_TENANT_LABELS tenants by name, then "other"."""
        if tenant in self._labels:
            return tenant
        if len(self._labels) < MAX_TENANT_LABELS:
            self._labels.add(tenant)
            return tenant
        return "other"

    def admit(self, route: routing_pb2.ModelRoute, tenant: str, band: int, weight: float) -> Ticket | None:
        """None: the request may go now. A Ticket: it waits (`wait`). Raises Shed when refused."""
        model = self._models.get(route.key)
        if model is None or not model.size:
            # Nobody waits: it goes while there is room, the reserve included (it is a sparse flow).
            if self.headroom(route)[0] - (model.granted if model is not None else 0) > 0:
                return None
            if model is None:
                model = self._models[route.key] = _ModelFlow(route)
        model.route = route
        loop = asyncio.get_running_loop()
        ticket = Ticket(tenant, band, weight, self._clock(), loop.create_future())
        if not route.endpoints:
            ticket.cold = ticket.waking = model.waking = True
        if model.size >= route.flow.max_queue:
            self._make_room(model, ticket)
        if model.bands[band].push(ticket) and model.size:
            # Its tenant had nothing held while others had: a sparse flow, which may take the reserve.
            ticket.sparse = True
            model.contended_at = ticket.enqueued
        model.size += 1
        self._on_change(route.key, self.label(tenant), BANDS[band], 1)
        self.kick(route.key)
        return ticket

    def _make_room(self, model: _ModelFlow, ticket: Ticket) -> None:
        """The queue is full: refuse `ticket` (raise Shed) or evict the request it replaces."""
        lowest = max(rank for rank, band in enumerate(model.bands) if band.size)
        key = model.route.key
        state = "is saturated" if model.route.endpoints else "is starting"
        if lowest < ticket.band:
            raise Shed(503, "model_saturated", f"model {key!r} {state} and holds higher-priority requests")
        band = model.bands[lowest]
        if lowest > ticket.band:
            victim_tenant = band.heaviest()
            shed = Shed(503, "shed", f"model {key!r} {state}: higher-priority requests took this one's place")
        else:
            victim_tenant = band.heaviest(ticket)
            shed = Shed(429, "over_share", f"tenant is over its share of model {key!r}; retry later")
            if victim_tenant == ticket.tenant:
                queue = band.queues.get(ticket.tenant)
                if queue is not None and len(queue) == model.size:  # nobody else waits: no share to be over
                    raise Shed(503, "model_saturated", f"model {key!r} {state}; retry later")
                raise shed
        victim = band.queues[victim_tenant][-1]
        band.remove(victim)
        model.size -= 1
        self._on_change(key, self.label(victim.tenant), BANDS[victim.band], -1)
        victim.future.set_exception(shed)

    async def wait(self, route: routing_pb2.ModelRoute, ticket: Ticket, deadline: float) -> float:
        """Until the ticket is dispatched: the seconds it waited. Raises Shed (evicted, timed out),
        or the activation's failure (`fail_waking`) for a request held while its model wakes.

        A request that came while the model had no endpoint waits until `deadline` (the activation
        timeout) for the model to turn ready, then up to the queue timeout from that moment on."""
        ticket.deadline = max(ticket.deadline, deadline)
        routed = False
        try:
            while True:
                until = ticket.deadline
                remaining = until - self._clock()
                if remaining <= 0:
                    raise TimeoutError
                try:
                    await asyncio.wait_for(asyncio.shield(ticket.future), remaining)
                    break
                except TimeoutError:
                    if ticket.deadline == until:  # not moved on meanwhile (its model turned ready)
                        raise
            routed = True
        except TimeoutError:
            if ticket.waking:
                raise Shed(
                    503,
                    "activation_timeout",
                    f"model {route.key!r} did not become ready within {route.cold.activation_timeout_ms // 1000}s",
                ) from None
            raise Shed(
                503, "queue_timeout", f"model {route.key!r} stayed saturated for {route.flow.queue_timeout_ms // 1000}s"
            ) from None
        finally:
            model = self._models.get(route.key)
            if ticket.granted:
                ticket.granted = False
                if model is not None:
                    model.granted -= 1
                    if not routed:  # dispatched, then its client left: its room goes to the next
                        self.kick(route.key)
            elif model is not None and not ticket.future.done():
                if model.bands[ticket.band].remove(ticket):  # timed out or client gone
                    model.size -= 1
                    self._on_change(route.key, self.label(ticket.tenant), BANDS[ticket.band], -1)
                ticket.future.cancel()
        return self._clock() - ticket.enqueued

    # -- dispatch -------------------------------------------------------------------------------

    def kick(self, key: str) -> None:
        """Dispatch the model's held requests that fit now, strictly by band, fairly within one."""
        model = self._models.get(key)
        if model is None:
            return
        if not model.size:
            if not model.granted:
                del self._models[key]
            return
        room, bulk = self.headroom(model.route)
        if self._clock() - model.contended_at >= RESERVE_SECONDS:
            bulk = room  # no sparse flow came lately: nothing to keep the reserve for
        room -= model.granted
        bulk -= model.granted
        while model.size and room > 0:
            # Flows with a backlog fill the room less the reserve; a sparse flow's request takes the
            # reserve, so a tenant within its share (or a higher band's first request) goes at once
            # rather than after the next request to finish.
            ticket = model.pop() if bulk > 0 else model.pop_sparse()
            if ticket is None:
                break
            self._on_change(key, self.label(ticket.tenant), BANDS[ticket.band], -1)
            ticket.granted = True
            model.granted += 1
            ticket.future.set_result(None)
            room -= 1
            bulk -= 1

    def kick_all(self) -> None:
        for key in list(self._models):
            self.kick(key)

    def on_routes(self, changed: list[routing_pb2.ModelRoute], removed: list[str]) -> None:
        """Follow route changes: new endpoints may take held requests; a model whose flow control
        went off or that is gone lets its held requests go (to be routed, or refused, as usual)."""
        for route in changed:
            model = self._models.get(route.key)
            if model is None:
                continue
            model.route = route
            if not route.flow.enabled:
                self._release(model)
                continue
            if model.waking and route.endpoints:
                # Ready: who waited for the wake may now wait up to the queue timeout for its turn.
                model.waking = False
                until = self._clock() + route.flow.queue_timeout_ms / 1000
                for ticket in model.tickets():
                    if ticket.waking:
                        ticket.waking = False
                        ticket.deadline = max(ticket.deadline, until)
            self.kick(route.key)
        for key in removed:
            model = self._models.get(key)
            if model is not None:
                self._release(model)

    def fail_waking(self, key: str, failure: Exception) -> None:
        """The model's activation failed: the requests held while it woke get `failure`."""
        model = self._models.get(key)
        if model is None or not model.waking:
            return
        model.waking = False
        for ticket in model.tickets():
            if ticket.waking and model.bands[ticket.band].remove(ticket):
                model.size -= 1
                self._on_change(key, self.label(ticket.tenant), BANDS[ticket.band], -1)
                ticket.future.set_exception(failure)
        self.kick(key)

    def _release(self, model: _ModelFlow) -> None:
        while model.size:
            ticket = model.pop()
            self._on_change(model.route.key, self.label(ticket.tenant), BANDS[ticket.band], -1)
            ticket.granted = True
            model.granted += 1
            ticket.future.set_result(None)

    def depths(self) -> dict[str, int]:
        """Held requests per model, for the models holding any."""
        return {key: model.size for key, model in self._models.items() if model.size}

    def depth(self, key: str) -> int:
        model = self._models.get(key)
        return model.size if model is not None else 0
