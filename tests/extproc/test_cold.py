"""Cold requests on their own: queue bounds, activation leases, wake-up on readiness, failures, timeouts."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from wakegate import contract
from wakegate.extproc.cold import (
    LEASE_GRACE_SECONDS,
    ActivationFailed,
    ActivationTimeout,
    ColdQueues,
    QueueFull,
)
from wakegate.v1 import routing_pb2


def route(*endpoints: str, failed: int = 0, max_queue: int = 2, timeout_ms: int = 60_000) -> routing_pb2.ModelRoute:
    return routing_pb2.ModelRoute(
        key="m",
        cluster="model.m",
        endpoints=[routing_pb2.Endpoint(address=e.split(":")[0], port=int(e.split(":")[1])) for e in endpoints],
        cold=routing_pb2.ColdPolicy(
            mode=contract.COLD_MODES["hold"], max_queue=max_queue, activation_timeout_ms=timeout_ms
        ),
        failed_activations=failed,
    )


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def changes() -> list[int]:
    return []


@pytest.fixture
def queues(clock: Clock, changes: list[int]) -> ColdQueues:
    return ColdQueues(lambda: changes.append(1), clock)


async def test_demand_starts_one_lease_until_it_ends(queues: ColdQueues, clock: Clock, changes: list[int]) -> None:
    queues.demand(route())
    queues.demand(route())
    assert queues.snapshot() == {"m": (0, 1, 0)}
    assert queues.queue("m").started_activations == 1
    assert len(changes) == 1  # the scaler hears the lease once
    clock.now += 61  # past the activation timeout
    assert queues.snapshot() == {}
    queues.demand(route())
    assert queues.queue("m").started_activations == 2


async def test_held_requests_wake_when_the_model_has_an_endpoint(queues: ColdQueues, clock: Clock) -> None:
    queues.demand(route())
    waiters = [asyncio.create_task(queues.wait(route(), clock.now + 30)) for _ in range(2)]
    await asyncio.sleep(0)
    assert queues.depth("m") == 2 and queues.snapshot()["m"][0] == 2
    queues.on_routes({"m": route("10.0.0.1:80")})
    await asyncio.wait_for(asyncio.gather(*waiters), 1)
    assert queues.depth("m") == 0
    clock.now += 2.5
    assert queues.flushed("m") == 2.5  # first held request sent on: timed once
    assert queues.flushed("m") is None
    # The lease outlives readiness by a grace, so the scaler sees demand until in-flight shows.
    clock.now += LEASE_GRACE_SECONDS - 2.5 - 0.1
    assert queues.snapshot() == {"m": (0, 1, 0)}
    clock.now += 0.2
    assert queues.expire() is None and queues.snapshot() == {}


async def test_a_full_queue_refuses_at_once(queues: ColdQueues, clock: Clock) -> None:
    held = [asyncio.create_task(queues.wait(route(max_queue=1), clock.now + 30))]
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await queues.wait(route(max_queue=1), clock.now + 30)
    held[0].cancel()
    with pytest.raises(asyncio.CancelledError):
        await held[0]
    assert queues.depth("m") == 0  # a client that went away frees its slot at once


async def test_a_failed_activation_fails_every_held_request(queues: ColdQueues, clock: Clock) -> None:
    queues.demand(route())
    waiter = asyncio.create_task(queues.wait(route(), clock.now + 30))
    await asyncio.sleep(0)
    queues.on_routes({"m": route(failed=1)})
    with pytest.raises(ActivationFailed):
        await asyncio.wait_for(waiter, 1)
    assert queues.snapshot() == {}  # the lease ended with the failure
    queues.demand(route(failed=1))
    assert queues.snapshot() == {"m": (0, 1, 1)}  # a new lease knows that failure


async def test_requests_failed_with_their_activation_stop_counting_before_their_tasks_run(
    queues: ColdQueues, clock: Clock
) -> None:
    """A demand report sent between the failure and the failed requests' tasks running must not
    show them held without a lease: the scaler would start an activation nobody waits for."""
    queues.demand(route())
    waiters = [asyncio.create_task(queues.wait(route(), clock.now + 30)) for _ in range(2)]
    await asyncio.sleep(0)
    assert queues.snapshot() == {"m": (2, 1, 0)}
    queues.on_routes({"m": route(failed=1)})
    assert queues.snapshot() == {} and queues.depth("m") == 0
    for waiter in waiters:
        with pytest.raises(ActivationFailed):
            await asyncio.wait_for(waiter, 1)
    assert queues.snapshot() == {} and queues.depth("m") == 0  # not counted down twice
    queues.demand(route(failed=1))
    again = asyncio.create_task(queues.wait(route(failed=1), clock.now + 30))
    await asyncio.sleep(0)
    assert queues.snapshot() == {"m": (1, 1, 1)}
    queues.on_routes({"m": route("10.0.0.1:80", failed=1)})
    await asyncio.wait_for(again, 1)
    assert queues.depth("m") == 0


async def test_a_first_request_after_a_failure_elsewhere_is_not_failed_by_it(queues: ColdQueues, clock: Clock) -> None:
    """This extproc never held a request for the model while its activation failed (the other
    extproc did): its first request waits for the new activation, not for the old failure."""
    failed = route(failed=1)
    failed.last_failure = "backend exited with code 3 while loading"
    queues.demand(failed)
    waiter = asyncio.create_task(queues.wait(failed, clock.now + 30))
    await asyncio.sleep(0)
    queues.on_routes({"m": failed})  # any later push of the same table
    await asyncio.sleep(0)
    assert not waiter.done()
    queues.on_routes({"m": route("127.0.0.1:9000", failed=1)})
    await asyncio.wait_for(waiter, 1)


async def test_a_failure_for_want_of_weights_carries_its_code(queues: ColdQueues, clock: Clock) -> None:
    queues.demand(route())
    first = asyncio.create_task(queues.wait(route(), clock.now + 30))
    await asyncio.sleep(0)
    failed = route(failed=1)
    failed.last_failure = "weights unavailable: registry 127.0.0.1:5000 is unreachable"
    failed.failure_code = contract.WEIGHTS_UNAVAILABLE
    queues.on_routes({"m": failed})
    with pytest.raises(ActivationFailed) as weights:
        await asyncio.wait_for(first, 1)
    assert weights.value.code == "weights_unavailable"
    assert weights.value.answer("m") == (
        "model 'm' cannot get its weights: weights unavailable: registry 127.0.0.1:5000 is unreachable"
    )
    # The next failure is an engine that crashed: the generic code again.
    queues.demand(failed)
    second = asyncio.create_task(queues.wait(failed, clock.now + 30))
    await asyncio.sleep(0)
    queues.on_routes({"m": route(failed=2)})
    with pytest.raises(ActivationFailed) as crashed:
        await asyncio.wait_for(second, 1)
    assert crashed.value.code == "activation_failed"
    assert crashed.value.answer("m") == "model 'm' failed to start: model failed to start"


async def test_a_removed_model_fails_its_requests(queues: ColdQueues, clock: Clock) -> None:
    waiter = asyncio.create_task(queues.wait(route(), clock.now + 30))
    await asyncio.sleep(0)
    queues.on_routes({})
    with pytest.raises(ActivationFailed, match="was removed"):
        await asyncio.wait_for(waiter, 1)


async def test_a_request_waits_only_until_its_own_deadline(queues: ColdQueues, clock: Clock) -> None:
    with pytest.raises(ActivationTimeout):
        await queues.wait(route(), clock.now + 0.05)
    with pytest.raises(ActivationTimeout):
        await queues.wait(route(), clock.now - 1)
    assert queues.depth("m") == 0


async def test_delivery_times_the_activation_signal_once(queues: ColdQueues, clock: Clock) -> None:
    queues.demand(route())
    clock.now += 0.25
    assert queues.delivered() == [("m", 0.25)]
    assert queues.delivered() == []


async def test_held_requests_wait_for_an_endpoint_not_for_any_route_push(queues: ColdQueues, clock: Clock) -> None:
    queues.demand(route())
    waiter = asyncio.create_task(queues.wait(route(), clock.now + 30))
    await asyncio.sleep(0)
    queues.on_routes({"m": route()})  # a push for the model, still without an endpoint
    await asyncio.sleep(0.01)
    assert not waiter.done() and queues.depth("m") == 1
    queues.on_routes({"m": route("10.0.0.1:80")})
    await asyncio.wait_for(waiter, 1)
    # Ready, then cold again (scaled to zero): a new request is held again, not waved through.
    queues.on_routes({"m": route()})
    again = asyncio.create_task(queues.wait(route(), clock.now + 30))
    await asyncio.sleep(0.01)
    assert not again.done() and queues.depth("m") == 1
    queues.on_routes({"m": route("10.0.0.2:80")})
    await asyncio.wait_for(again, 1)


async def test_a_thousand_held_requests_are_released_a_batch_per_loop_turn(queues: ColdQueues, clock: Clock) -> None:
    """Between batches the loop turns (and reads its sockets: Envoy's keepalive pings), so a
    model waking with thousands held does not look like a stalled extproc; all are released,
    in the order they came."""
    held = 1000
    queues.demand(route())
    released: list[int] = []

    async def hold(index: int) -> None:
        await queues.wait(route(max_queue=held), clock.now + 30)
        released.append(index)

    waiters = [asyncio.create_task(hold(i)) for i in range(held)]
    await asyncio.sleep(0)
    assert queues.depth("m") == held
    seen: list[int] = []
    loop = asyncio.get_running_loop()

    def probe() -> None:  # one callback per loop turn, as a socket read would be
        seen.append(len(released))
        if len(released) < held:
            loop.call_soon(probe)

    queues.on_routes({"m": route("10.0.0.1:80")})
    loop.call_soon(probe)
    await asyncio.wait_for(asyncio.gather(*waiters), 5)
    assert sorted(released) == list(range(held))
    steps = [after - before for before, after in itertools.pairwise(seen)]
    assert max(steps) <= 128, steps  # never more than a batch between two turns
    assert len(seen) >= held // 128
