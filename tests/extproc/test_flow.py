"""Flow control's admission rules (extproc/flow.py), with engine readings and in-flight counts set
by the test: saturation, fair shares by weight, strict bands, shedding, timeouts."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from wakegate.extproc.flow import FlowControl, Shed, Ticket
from wakegate.extproc.scheduling import EngineState
from wakegate.v1 import routing_pb2

EP = "10.0.0.1:8000"


def route(
    max_queue: int = 100, max_in_flight: int = 0, max_waiting: int = 1, timeout_ms: int = 30000
) -> routing_pb2.ModelRoute:
    return routing_pb2.ModelRoute(
        key="m",
        endpoints=[routing_pb2.Endpoint(address="10.0.0.1", port=8000)],
        flow=routing_pb2.FlowControl(
            enabled=True,
            band="standard",
            max_queue=max_queue,
            queue_timeout_ms=timeout_ms,
            max_waiting=max_waiting,
            max_in_flight=max_in_flight,
        ),
    )


class Engine:
    """One endpoint: what the engine reports and what this gateway has in flight on it."""

    def __init__(self) -> None:
        self.book: dict[str, EngineState] = {}
        self.inflight = 0
        self.now = 1000.0
        self.flow = FlowControl(self.book, lambda ep: self.inflight, clock=lambda: self.now)

    def read(self, running: int, waiting: int, own: int | None = None) -> None:
        """A reading; `own`: this gateway's count at the reading when it differs from its count now."""
        self.book[EP] = EngineState(
            waiting=float(waiting),
            running=float(running),
            kv_usage=0.1,
            own=float(self.inflight if own is None else own),
        )
        self.flow.engines_read()


async def dispatched(
    flow: FlowControl, r: routing_pb2.ModelRoute, tickets: list[Ticket], engine: Engine, n: int
) -> list[Ticket]:
    """Let `n` requests finish one by one; the tickets dispatched, in order."""
    order: list[Ticket] = []
    for _ in range(n):
        engine.inflight -= 1
        flow.kick(r.key)
        for t in tickets:
            if t.granted and t not in order:
                order.append(t)
                await flow.wait(r, t, engine.now + 1)  # as the held request does
                engine.inflight += 1
    return order


async def test_engine_signals_learn_the_cap_and_the_gateway_count_fills_in_between_readings() -> None:
    engine = Engine()
    r = route(max_waiting=1)
    assert engine.flow.admit(r, "a", 1, 1.0) is None  # nothing known yet: not saturated
    engine.inflight = 9
    engine.read(running=8, waiting=1)  # runs 8 at once; one waits: saturated (max_waiting 1)
    assert engine.flow.caps[EP] == 8
    ticket = engine.flow.admit(r, "a", 1, 1.0)
    assert ticket is not None and not ticket.future.done()
    engine.inflight -= 1  # one finished since the reading: the engine's queue is empty again
    engine.flow.kick("m")
    assert not ticket.future.done()  # max_waiting 1: none may be left waiting in the engine
    engine.inflight -= 1  # another one: a free slot
    engine.flow.kick("m")
    assert ticket.future.done() and ticket.granted


async def test_a_request_the_engine_finished_frees_one_slot_not_two() -> None:
    engine = Engine()
    r = route(max_waiting=1)
    engine.inflight = 17
    engine.read(running=16, waiting=1)  # runs 16 at once
    engine.inflight = 16
    held = [engine.flow.admit(r, "a", 1, 1.0) for _ in range(3)]
    # One request ended in the engine; its end has not reached this gateway yet (its count is 16).
    engine.read(running=15, waiting=0)
    engine.inflight = 15  # now it has: the one free slot is taken once, not once per source
    engine.flow.kick("m")
    assert [t is not None and t.granted for t in held] == [True, False, False]


async def test_a_sparse_tenant_takes_the_reserve_while_a_backlogged_one_leaves_it_free() -> None:
    engine = Engine()
    r = route(max_waiting=1)
    engine.inflight = 13
    engine.read(running=12, waiting=1)  # runs 12 at once: one slot of them is the reserve
    engine.inflight = 12
    loud = [engine.flow.admit(r, "loud", 1, 1.0) for _ in range(10)]
    first = engine.flow.admit(r, "quiet", 1, 1.0)
    assert first is not None and not first.granted  # full: the next slot to free is its
    order = await dispatched(engine.flow, r, [t for t in [first, *loud] if t is not None], engine, 1)
    assert order == [first]
    engine.inflight -= 1  # a loud request ends: the loud backlog leaves that slot free ...
    engine.flow.kick("m")
    assert not any(t is not None and t.granted for t in loud)
    second = engine.flow.admit(r, "quiet", 1, 1.0)  # ... and the quiet tenant's next request goes at once
    assert second is not None and second.granted
    await engine.flow.wait(r, second, engine.now + 1)
    engine.inflight += 1
    engine.now += 10  # no sparse flow lately: the backlog may use every slot
    engine.inflight -= 1
    engine.flow.kick("m")
    assert sum(t is not None and t.granted for t in loud) == 1


async def test_in_flight_limit_holds_without_engine_signals() -> None:
    engine = Engine()
    r = route(max_in_flight=2, max_waiting=0)
    engine.inflight = 2
    assert engine.flow.admit(r, "a", 1, 1.0) is not None
    engine.inflight = 1
    assert engine.flow.admit(r, "b", 1, 1.0) is not None  # others wait: no overtaking
    assert engine.flow.depth("m") == 1  # the first was dispatched by the second's arrival


async def test_weighted_shares_within_a_band_and_strict_bands() -> None:
    engine = Engine()
    r = route(max_in_flight=1, max_waiting=0)
    engine.inflight = 1
    tickets = [engine.flow.admit(r, "heavy", 1, 3.0) for _ in range(30)]
    tickets += [engine.flow.admit(r, "light", 1, 1.0) for _ in range(30)]
    critical = [engine.flow.admit(r, "light", 0, 1.0) for _ in range(3)]
    assert all(t is not None for t in tickets + critical)
    held = [t for t in tickets + critical if t is not None]
    order = await dispatched(engine.flow, r, held, engine, 23)
    assert order[:3] == critical  # the critical band first, whoever its tenant
    shares = Counter(t.tenant for t in order[3:])
    assert shares == {"heavy": 15, "light": 5}  # weight 3 : 1


async def test_full_queue_sheds_lowest_band_first_and_the_heaviest_tenant_within_a_band() -> None:
    engine = Engine()
    r = route(max_queue=4, max_in_flight=1, max_waiting=0)
    engine.inflight = 1
    low = [engine.flow.admit(r, "a", 2, 1.0) for _ in range(2)]
    std = [engine.flow.admit(r, "a", 1, 1.0) for _ in range(2)]
    # full: a standard request takes the place of the newest sheddable one
    engine.flow.admit(r, "b", 1, 1.0)
    assert low[1] is not None and isinstance(low[1].future.exception(), Shed)
    assert low[1].future.exception().status == 503  # type: ignore[union-attr]
    engine.flow.admit(r, "b", 1, 1.0)  # and the next one the last sheddable one
    assert low[0] is not None and low[0].future.done()
    # full of standard requests: tenant a (2 held) and b (2 held); a third from b is over its share
    with pytest.raises(Shed) as info:
        engine.flow.admit(r, "b", 1, 1.0)
    assert info.value.status == 429 and info.value.code == "over_share"
    # a sheddable request below everything held: the model cannot take it
    with pytest.raises(Shed) as info:
        engine.flow.admit(r, "c", 2, 1.0)
    assert info.value.status == 503
    assert all(t is not None and not t.future.done() for t in std)


async def test_a_held_request_times_out_and_leaves_the_queue() -> None:
    engine = Engine()
    r = route(max_in_flight=1, max_waiting=0, timeout_ms=50)
    engine.inflight = 1
    ticket = engine.flow.admit(r, "a", 1, 1.0)
    assert ticket is not None
    with pytest.raises(Shed) as info:
        await engine.flow.wait(r, ticket, engine.now + 0.05)
    assert info.value.code == "queue_timeout" and engine.flow.depth("m") == 0


def test_token_budget_window_and_usage_of_json_and_sse_responses() -> None:
    from wakegate.extproc.budget import TokenBudgets, Usage

    now = [1000.0]
    budgets = TokenBudgets(clock=lambda: now[0])
    budgets.add("t", 40)
    now[0] += 30
    budgets.add("t", 30)
    assert budgets.retry_after("t", 100) == 0 and budgets.retry_after("u", 1) == 0
    assert budgets.retry_after("t", 70) == pytest.approx(30)  # the first 40 leave the window then
    now[0] += 31
    assert budgets.used("t") == 30
    body = Usage("t")
    body.feed(b'{"choices":[],"usage":{"prompt_tokens":7,"total_tokens":19,"completion_tokens":12}}')
    assert body.tokens() == 19
    sse = Usage("t")
    for _ in range(5):
        sse.feed(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n')
    assert sse.tokens() == 5  # no usage in the stream: one per event
    sse.feed(b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5,"total_tokens":8}}\n\n')
    sse.feed(b"data: [DONE]\n\n")
    assert sse.tokens() == 8


async def test_requests_of_a_cold_model_wait_in_the_queues_by_band_until_it_is_ready() -> None:
    engine = Engine()
    ready = route(max_queue=3, max_in_flight=1, max_waiting=0)
    cold = routing_pb2.ModelRoute()
    cold.CopyFrom(ready)
    del cold.endpoints[:]
    cold.cold.activation_timeout_ms = 60000
    bulk = [engine.flow.admit(cold, "d", 2, 1.0) for _ in range(3)]
    assert all(t is not None and t.cold and not t.granted for t in bulk)  # no endpoint: all held
    crit = engine.flow.admit(cold, "c", 0, 1.0)  # full: it takes the newest sheddable one's place
    assert crit is not None and bulk[2] is not None
    assert isinstance(bulk[2].future.exception(), Shed) and bulk[2].future.exception().code == "shed"  # type: ignore[union-attr]
    waits = [asyncio.ensure_future(engine.flow.wait(cold, t, engine.now + 60)) for t in (bulk[0], bulk[1], crit)]
    await asyncio.sleep(0)
    engine.now += 40  # ready after 40 s: each may now wait the queue timeout (30 s) from then on
    engine.flow.on_routes([ready], [])
    assert crit.granted and not bulk[0].granted  # one at a time (max_in_flight 1), critical first
    await waits[2]
    engine.inflight += 1  # routed
    assert bulk[0].deadline == bulk[1].deadline == engine.now + 30
    engine.flow.kick("m")  # still one in flight: the sheddable ones wait
    assert not bulk[0].granted
    engine.flow.fail_waking("m", RuntimeError("a failure after readiness is not theirs"))
    assert not bulk[0].future.done()
    for task in waits[:2]:
        task.cancel()
    await asyncio.gather(*waits[:2], return_exceptions=True)


async def test_a_failed_activation_or_its_timeout_ends_the_wait_of_requests_held_for_a_cold_model() -> None:
    engine = Engine()
    cold = route(max_in_flight=1, max_waiting=0)
    del cold.endpoints[:]
    cold.cold.activation_timeout_ms = 1000
    failing = engine.flow.admit(cold, "a", 1, 1.0)
    assert failing is not None
    engine.flow.fail_waking("m", RuntimeError("the engine exited"))
    with pytest.raises(RuntimeError, match="exited"):
        await engine.flow.wait(cold, failing, engine.now + 60)
    assert engine.flow.depth("m") == 0
    late = engine.flow.admit(cold, "a", 1, 1.0)
    assert late is not None
    with pytest.raises(Shed) as info:
        await engine.flow.wait(cold, late, engine.now + 0.05)  # never ready within its activation timeout
    assert info.value.code == "activation_timeout" and engine.flow.depth("m") == 0
