"""The gateway's side of on-demand LoRA adapters (extproc/adapters.py): where a request may go, how
a held one is released or refused, and what the demand report says to `up`."""

from __future__ import annotations

import asyncio
import time

import pytest

from wakegate.extproc.adapters import AdapterBook, AdapterFailed, Placement, adapter_route, placement
from wakegate.extproc.cold import ActivationTimeout, QueueFull
from wakegate.v1 import routing_pb2

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def route(
    holders: dict[str, list[str]],
    *,
    ready: tuple[str, ...] = (A, B),
    failed: int = 0,
    placement_rule: str = "affinity",
    on_demand: bool = True,
) -> routing_pb2.ModelRoute:
    return routing_pb2.ModelRoute(
        key="chat",
        endpoints=[routing_pb2.Endpoint(address=ep.split(":")[0], port=int(ep.split(":")[1])) for ep in ready],
        adapters=[
            routing_pb2.LoRAAdapterRoute(
                name=name,
                names=[name],
                served_name=name,
                endpoints=eps,
                failed_loads=failed,
                last_failure="weights unavailable: gone",
            )
            for name, eps in holders.items()
        ],
        adapters_on_demand=on_demand,
        adapter_placement=placement_rule if on_demand else "",
    )


def test_affinity_places_on_ready_holders_only() -> None:
    r = route({"sql": [B, "10.0.0.9:8000"], "poet": []})
    assert placement(r, adapter_route(r, "sql"), lambda n: 0) == Placement((B,))  # type: ignore[arg-type]
    assert placement(r, adapter_route(r, "poet"), lambda n: 0) == Placement(())  # type: ignore[arg-type]
    assert adapter_route(r, "other") is None and adapter_route(r, None) is None
    assert adapter_route(route({"sql": [A]}, on_demand=False), "sql") is None  # every endpoint serves it


def test_random_placement_draws_any_ready_endpoint_and_asks_for_it_there() -> None:
    r = route({"sql": [A]}, placement_rule="random")
    lora = adapter_route(r, "sql")
    assert lora is not None
    assert placement(r, lora, lambda n: 0) == Placement((A,), A)
    assert placement(r, lora, lambda n: 1) == Placement((), B)


async def test_a_held_request_goes_once_an_endpoint_holds_its_adapter() -> None:
    book = AdapterBook(lambda: None)
    book.on_routes({"chat": route({"sql": []})})
    waiter = asyncio.create_task(book.wait("chat", "sql", "", time.monotonic() + 5, max_queue=10))
    await asyncio.sleep(0.01)
    assert book.depth("chat") == 1
    (demand,) = book.report()["chat"]
    assert (demand.adapter, demand.queued) == ("sql", 1)
    book.on_routes({"chat": route({"sql": ["10.0.0.9:8000"]})})  # not a ready endpoint: still held
    await asyncio.sleep(0.01)
    assert not waiter.done()
    book.on_routes({"chat": route({"sql": [A]})})
    assert await asyncio.wait_for(waiter, 1) == Placement((A,))
    assert book.depth("chat") == 0 and book.report() == {}


async def test_a_random_hold_waits_for_its_own_endpoint() -> None:
    book = AdapterBook(lambda: None)
    book.on_routes({"chat": route({"sql": [A]}, placement_rule="random")})
    waiter = asyncio.create_task(book.wait("chat", "sql", B, time.monotonic() + 5, max_queue=10))
    await asyncio.sleep(0.01)
    (demand,) = book.report()["chat"]
    assert demand.queued == 0 and [(u.endpoint, u.queued) for u in demand.uses] == [(B, 1)]
    book.on_routes({"chat": route({"sql": [A, B]}, placement_rule="random")})
    assert await asyncio.wait_for(waiter, 1) == Placement((B,), B)


async def test_a_failed_load_fails_the_held_requests_with_its_reason() -> None:
    book = AdapterBook(lambda: None)
    book.on_routes({"chat": route({"sql": []}, failed=1)})  # an earlier failure does not count
    waiter = asyncio.create_task(book.wait("chat", "sql", "", time.monotonic() + 5, max_queue=10))
    await asyncio.sleep(0.01)
    book.on_routes({"chat": route({"sql": []}, failed=2)})
    with pytest.raises(AdapterFailed, match="weights unavailable: gone"):
        await asyncio.wait_for(waiter, 1)
    assert book.depth("chat") == 0


async def test_held_requests_are_bounded_and_time_out() -> None:
    book = AdapterBook(lambda: None)
    book.on_routes({"chat": route({"sql": []})})
    with pytest.raises(QueueFull):
        await book.wait("chat", "sql", "", time.monotonic() + 5, max_queue=3, depth_elsewhere=3)
    with pytest.raises(ActivationTimeout):
        await book.wait("chat", "sql", "", time.monotonic() + 0.05, max_queue=3)
    book.on_routes({})
    with pytest.raises(ActivationTimeout):  # the model went away
        await book.wait("chat", "sql", "", time.monotonic() + 5, max_queue=3)


def test_use_per_endpoint_is_reported_until_the_endpoint_leaves() -> None:
    changes: list[int] = []
    book = AdapterBook(lambda: changes.append(1))
    book.on_routes({"chat": route({"sql": [A]})})
    book.started("chat", "sql", A)
    book.started("chat", "sql", A)
    book.ended("chat", "sql", A)
    (demand,) = book.report()["chat"]
    assert [(u.endpoint, u.in_flight, u.routed) for u in demand.uses] == [(A, 1, 2)]
    book.ended("chat", "sql", A)
    book.ended("chat", "sql", A)  # never below zero
    assert book.in_flight("chat", "sql", A) == 0
    (demand,) = book.report()["chat"]
    assert [(u.in_flight, u.routed) for u in demand.uses] == [(0, 2)]  # the use stays visible
    book.on_routes({"chat": route({"sql": [B]}, ready=(B,))})
    assert book.report() == {}


async def test_a_hold_is_released_only_to_a_holder_that_is_ready() -> None:
    """The route's adapter list may name an endpoint its endpoints do not (yet) have: Envoy has
    not confirmed it, or it left; a request held for it keeps waiting, or draws again."""
    book = AdapterBook(lambda: None)
    book.on_routes({"chat": route({"sql": [B]}, ready=(A,))})
    waiter = asyncio.create_task(book.wait("chat", "sql", "", time.monotonic() + 5, max_queue=10))
    drawn = asyncio.create_task(book.wait("chat", "sql", B, time.monotonic() + 5, max_queue=10))
    await asyncio.sleep(0.01)
    assert not waiter.done() and not drawn.done()  # B holds sql but is not ready
    (demand,) = book.report()["chat"]
    assert [(u.endpoint, u.queued) for u in demand.uses] == [(A, 1)]  # the drawn one drew A instead
    book.on_routes({"chat": route({"sql": [A, B]}, ready=(A,))})
    assert await asyncio.wait_for(waiter, 1) == Placement((A,))
    assert await asyncio.wait_for(drawn, 1) == Placement((A,), A)
