"""Parked cold requests (extproc/park.py): the tickets, the Processor's park decision and what a
released request is spared, and the park itself served over real HTTP/2 on loopback.

The whole path through a real Envoy (its park route, the 307 it follows, a parking extproc that
dies) is in tests/reliability/test_faults.py and tests/cold; here each piece is looked at alone.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import pytest

from tests.extproc.test_service import body, decide, gateway, headers, immediate, route, set_headers
from tests.support.h2requests import Answer, Connection
from tests.support.waiting import waited
from wakegate import contract
from wakegate.extproc.exchange import Cold
from wakegate.extproc.gateway import Gateway
from wakegate.extproc.h2grpc.call import GrpcServer
from wakegate.extproc.park import RELEASE_SECONDS, RELEASE_STALL_SECONDS, RELEASE_WINDOW, Parker, Tickets
from wakegate.extproc.service import Processor

CHAT = {"model": "waiting", "messages": [{"role": "user", "content": "hi"}]}


# -- tickets ------------------------------------------------------------------------------------


def test_a_ticket_reads_back_what_was_signed_for_any_name() -> None:
    tickets = Tickets()
    for key, name in [("chat", "chat"), ("team/a.b", "org/Model-v1.5 ünïcode %41.x")]:
        assert tickets.read("park", tickets.park(key, name, 1_900_000_000.25)) == (key, name, 1_900_000_000.25)
        read = tickets.read("release", tickets.release(key, name))
        assert read is not None and read[:2] == (key, name)


def test_a_ticket_is_refused_when_forged_of_another_kind_expired_or_from_another_secret() -> None:
    now = [1_000.0]
    tickets = Tickets(b"s" * 32, clock=lambda: now[0])
    park = tickets.park("chat", "chat", 2_000.0)
    expiry, mac, key, name = park.split(":")
    assert tickets.read("release", park) is None  # a park ticket does not release
    assert tickets.read("park", f"{expiry}:{mac}:other:{name}") is None
    assert tickets.read("park", f"9{expiry}:{mac}:{key}:{name}") is None
    assert tickets.read("park", "") is None and tickets.read("park", "a:b:c:d:e") is None
    assert Tickets(b"t" * 32).read("park", park) is None
    release = tickets.release("chat", "chat")
    now[0] += RELEASE_SECONDS + 1
    assert tickets.read("release", release) is None


def test_both_extprocs_of_a_gateway_read_each_others_tickets_through_their_shared_token() -> None:
    one, other = Tickets.from_token("internal-token"), Tickets.from_token("internal-token")
    assert other.read("release", one.release("chat", "chat")) is not None
    assert Tickets.from_token("another").read("release", one.release("chat", "chat")) is None
    assert Tickets.from_token(None).read("release", Tickets.from_token(None).release("chat", "chat")) is None


# -- the Processor's decision --------------------------------------------------------------------


def parking(gw: Gateway | None = None) -> tuple[Processor, Tickets]:
    tickets = Tickets()
    return Processor(gw or gateway(), tickets), tickets


async def test_a_cold_request_whose_body_envoy_holds_is_parked_not_held_in_its_stream() -> None:
    proc, tickets = parking()
    ex, decided = decide(proc, headers("/v1/chat/completions"), body(CHAT))
    sent = set_headers(decided.request_body.response)
    assert sent[contract.CLUSTER_HEADER] == contract.PARK_CLUSTER
    key, name, deadline = tickets.read("park", sent[contract.PARK_HEADER]) or ("", "", 0.0)
    assert (key, name) == ("waiting", "waiting")
    assert 4 < deadline - time.time() <= 5  # the model's activation timeout, 5 s
    assert decided.request_body.response.clear_route_cache
    # The body goes back as it came (Envoy copies it out of its connection's read buffer)...
    assert decided.request_body.response.body_mutation.body == body(CHAT).request_body.body
    # ...unless it fills slices of its own anyway.
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 20_000}]}
    _, decided = decide(proc, headers("/v1/chat/completions"), body(big))
    assert set_headers(decided.request_body.response)[contract.CLUSTER_HEADER] == contract.PARK_CLUSTER
    assert not decided.request_body.response.HasField("body_mutation")
    assert proc.gw.cold.depth("waiting") == 0  # counted where it waits, at the park
    assert ex.model_key is None  # nothing in flight: its stream ends now


async def test_without_tickets_or_when_envoy_streams_the_body_a_cold_request_is_held_in_its_stream() -> None:
    assert isinstance(decide(Processor(gateway()), headers("/v1/chat/completions"), body(CHAT))[1], Cold)
    proc, _ = parking()
    # Named in a header with a body still to come: Envoy does not hold that body for a redirect.
    assert isinstance(decide(proc, headers("/v1/chat/completions", **{"x-model-id": "waiting"}))[1], Cold)
    # No body at all: parked.
    _, decided = decide(proc, headers("/v1/chat/completions", end=True, **{"x-model-id": "waiting"}))
    assert set_headers(decided.request_headers.response)[contract.CLUSTER_HEADER] == contract.PARK_CLUSTER


async def test_a_full_cold_queue_refuses_before_parking() -> None:
    proc, _ = parking()
    queue = proc.gw.cold.join(proc.gw.table.routes["waiting"])
    proc.gw.cold.join(proc.gw.table.routes["waiting"])  # max_queue 2
    status, sent, payload = immediate(decide(proc, headers("/v1/chat/completions"), body(CHAT))[1])
    assert (status, payload["error"]["code"], sent["retry-after"]) == (429, "queue_full", "5")
    proc.gw.cold.left(queue, queue.generation, 2)


async def test_a_released_request_is_not_counted_again_nor_parked_twice() -> None:
    gw = gateway()
    gw.set_routes([route("limited", "10.0.0.3:8000", rps=1), route("waiting")])
    proc, tickets = parking(gw)
    back: list[int] = []
    proc.on_released = lambda: back.append(1)
    chat = {**CHAT, "model": "limited"}
    released = {contract.RELEASE_HEADER: tickets.release("limited", "limited")}
    assert decide(proc, headers("/v1/chat/completions"), body(chat))[1].WhichOneof("response") == "request_body"
    # The bucket (1 rps, burst 1) is empty now: a new request is refused, a released one goes on.
    assert immediate(decide(proc, headers("/v1/chat/completions"), body(chat))[1])[0] == 429
    _, decided = decide(proc, headers("/v1/chat/completions", **released), body(chat))
    assert set_headers(decided.request_body.response)[contract.CLUSTER_HEADER] == "model.limited"
    assert contract.RELEASE_HEADER in decided.request_body.response.header_mutation.remove_headers
    assert back == [1]  # the park hears that one of its releases came back
    # A ticket for another model, or one that does not verify, spares nothing.
    other = {contract.RELEASE_HEADER: tickets.release("waiting", "waiting")}
    assert immediate(decide(proc, headers("/v1/chat/completions", **other), body(chat))[1])[0] == 429
    forged = {contract.RELEASE_HEADER: "-"}
    assert immediate(decide(proc, headers("/v1/chat/completions", **forged), body(chat))[1])[0] == 429
    # Sent back while its model is cold again: held in its stream (Envoy follows one redirect).
    again = {contract.RELEASE_HEADER: tickets.release("waiting", "waiting")}
    assert isinstance(decide(proc, headers("/v1/chat/completions", **again), body(CHAT))[1], Cold)
    assert isinstance(decide(proc, headers("/v1/chat/completions", **forged), body(CHAT))[1], Cold)


# -- the park, over HTTP/2 -----------------------------------------------------------------------


class Park:
    def __init__(self, proc: Processor, tickets: Tickets, parker: Parker, conn: Connection) -> None:
        self.proc, self.tickets, self.parker, self.conn = proc, tickets, parker, conn

    def send(self, key: str = "waiting", *, timeout: float = 5.0, ticket: str | None = None) -> asyncio.Future[Answer]:
        if ticket is None:
            ticket = self.tickets.park(key, key, time.time() + timeout)
        fields = {"content-type": "application/json", "x-forwarded-proto": "https", contract.PARK_HEADER: ticket}
        path = "/v1/chat/completions?x=1"
        return self.conn.request("POST", path, "gw.example:8443", fields, json.dumps(CHAT).encode())

    def ready(self, key: str = "waiting") -> None:
        self.proc.gw.update_routes([route(key, "10.0.0.9:8000")], [])


@pytest.fixture
async def park() -> AsyncIterator[Park]:
    proc, tickets = parking()
    roomy = route("waiting")
    roomy.cold.max_queue = 1000
    proc.gw.update_routes([roomy], [])
    parker = Parker(proc, tickets)
    server = GrpcServer({}, http=parker.stream)
    address = await server.listen("127.0.0.1:0")
    host, _, port = address.rpartition(":")
    conn = await Connection.open(host, int(port))
    try:
        yield Park(proc, tickets, parker, conn)
    finally:
        await conn.close()
        await server.stop(0)


def depth(park: Park) -> float | None:
    """wakegate_gateway_queue_depth of the model, as the dashboards read it."""
    return park.proc.gw.metrics.registry.get_sample_value("wakegate_gateway_queue_depth", {"model": "waiting"})


def error_of(answer: Answer) -> tuple[int, str]:
    return answer.status, json.loads(answer.body)["error"]["code"]


async def test_parked_requests_are_sent_back_with_a_release_ticket_when_their_model_is_ready(park: Park) -> None:
    sent = [park.send() for _ in range(300)]
    await waited(lambda: park.parker.parked == 300, 5, "300 parked")
    assert park.proc.gw.cold.depth("waiting") == 300
    assert park.proc.gw.held()["waiting"][0] == 300  # reported as queued demand
    assert depth(park) == 300
    park.ready()
    answers = await asyncio.gather(*sent)
    for answer in answers:
        assert answer.status == 307 and not answer.body
        assert answer.headers["location"] == "https://gw.example:8443/v1/chat/completions?x=1"
        assert park.tickets.read("release", answer.headers[contract.RELEASE_HEADER]) is not None
    assert park.proc.gw.cold.depth("waiting") == 0 and park.parker.parked == 0 and depth(park) == 0


async def test_released_requests_go_back_a_window_at_a_time_as_earlier_ones_come_back(park: Park) -> None:
    sent = [park.send() for _ in range(RELEASE_WINDOW + 40)]
    await waited(lambda: park.parker.parked == RELEASE_WINDOW + 40, 5, "all parked")
    park.ready()
    answered = lambda: sum(f.done() for f in sent)  # noqa: E731
    await waited(lambda: answered() == RELEASE_WINDOW, 2, "a window released")
    await asyncio.sleep(0.2)
    assert answered() == RELEASE_WINDOW  # the rest wait for those to come back...
    for _ in range(10):
        park.proc.on_released()  # ...as the Processor says when a release ticket reaches it
    await waited(lambda: answered() == RELEASE_WINDOW + 10, 2, "ten more")
    # Nothing else comes back (they went to the other extproc): the window opens again.
    started = time.monotonic()
    assert all(a.status == 307 for a in await asyncio.gather(*sent))
    assert time.monotonic() - started < RELEASE_STALL_SECONDS + 1


async def test_a_parked_request_past_its_deadline_gets_the_activation_timeout(park: Park) -> None:
    early, late = park.send(timeout=0.3), park.send(timeout=30)
    assert error_of(await early) == (503, "activation_timeout")
    assert park.parker.parked == 1 and park.proc.gw.cold.depth("waiting") == 1 and depth(park) == 1
    park.ready()
    assert (await late).status == 307


async def test_a_failed_activation_answers_every_parked_request_with_its_failure(park: Park) -> None:
    sent = [park.send() for _ in range(3)]
    await waited(lambda: park.parker.parked == 3, 5, "3 parked")
    failed = route("waiting")
    failed.failed_activations = 1
    failed.last_failure = "out of memory"
    park.proc.gw.update_routes([failed], [])
    for answer in await asyncio.gather(*sent):
        assert error_of(answer) == (503, "activation_failed")
        assert "out of memory" in json.loads(answer.body)["error"]["message"]
        assert answer.headers["retry-after"] == "5"
    assert park.proc.gw.cold.depth("waiting") == 0 and depth(park) == 0


async def test_past_max_queue_the_park_refuses_and_a_gone_client_frees_its_place(park: Park) -> None:
    park.proc.gw.update_routes([route("waiting")], [])  # max_queue 2
    first, second = park.send(), park.send()
    await waited(lambda: park.parker.parked == 2, 5, "2 parked")
    assert error_of(await park.send()) == (429, "queue_full")
    await park.conn.reset(1)
    await waited(lambda: park.proc.gw.cold.depth("waiting") == 1, 5, "the reset request left the queue")
    assert depth(park) == 1
    third = park.send()
    await waited(lambda: park.parker.parked == 2, 5, "2 parked again")
    park.ready()
    assert [(await a).status for a in (second, third)] == [307, 307]
    assert first.done()


async def test_a_stopping_extproc_answers_its_parked_requests_with_the_unserved_503(park: Park) -> None:
    sent = [park.send() for _ in range(2)]
    await waited(lambda: park.parker.parked == 2, 5, "2 parked")
    assert park.parker.let_go() == 2
    for answer in await asyncio.gather(*sent):
        assert error_of(answer) == (503, "gateway_unavailable")
        assert answer.headers[contract.UNSERVED_HEADER] == "1"
    assert park.proc.gw.cold.depth("waiting") == 0


async def test_a_ticket_that_does_not_verify_is_sent_back_unreleased_and_no_ticket_is_not_ours(park: Park) -> None:
    answer = await park.send(ticket=Tickets().park("waiting", "waiting", time.time() + 5))
    assert (answer.status, answer.headers[contract.RELEASE_HEADER]) == (307, "-")
    # Ready already, or gone: sent back at once to be decided (routed, or a 404).
    park.ready()
    answer = await park.send()
    assert answer.status == 307 and park.tickets.read("release", answer.headers[contract.RELEASE_HEADER])
    assert (await park.send("nothing")).status == 307
    plain = await park.conn.request("POST", "/", "x", {"content-type": "application/json"}, b"{}")
    assert plain.status == 415  # not a parked request: what any HTTP request to extproc gets
