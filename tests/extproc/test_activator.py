"""The activator on its own: real HTTP on loopback, a small streaming backend, routes pushed by hand.

The whole keepalive path through Envoy is in tests/cold; here each outcome a client can see
after the activator's 200 is checked in the bytes it receives.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from wakegate import contract
from wakegate.control.admin import free_port
from wakegate.extproc.activator import Activator, start
from wakegate.extproc.auth import ApiKeys
from wakegate.extproc.gateway import Gateway, Settings
from wakegate.v1 import routing_pb2

BODY = {"model": "m", "stream": True, "messages": []}


def route(*endpoints: tuple[str, int], failed: int = 0) -> routing_pb2.ModelRoute:
    return routing_pb2.ModelRoute(
        key="m",
        names=["m"],
        served_name="m",
        cluster="model.m",
        endpoints=[routing_pb2.Endpoint(address=a, port=p) for a, p in endpoints],
        cold=routing_pb2.ColdPolicy(mode=contract.COLD_MODES["keepalive"], max_queue=4, activation_timeout_ms=10_000),
        failed_activations=failed,
    )


class Backend:
    """A streaming model server on loopback that records what it was sent."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.seen: list[tuple[dict[str, str], Any]] = []
        self.port = free_port()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.seen.append((dict(request.headers), await request.json()))
        if self.status != 200:
            return web.json_response({"error": "boom"}, status=self.status)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for piece in ("Hello", "world"):
            await response.write(f"data: {json.dumps({'piece': piece})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response


@pytest.fixture
async def served() -> AsyncIterator[tuple[Gateway, str, Backend]]:
    gateway = Gateway(Settings(), ApiKeys(None))
    gateway.set_routes([route()])
    backend = Backend()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", backend.handle)
    backend_runner = web.AppRunner(app)
    await backend_runner.setup()
    await web.TCPSite(backend_runner, "127.0.0.1", backend.port).start()
    activator = Activator(gateway, heartbeat_seconds=0.05)
    port = free_port()
    runner = await start(activator, "127.0.0.1", port)
    yield gateway, f"http://127.0.0.1:{port}/v1/chat/completions", backend
    await runner.cleanup()
    await activator.close()
    await backend_runner.cleanup()


async def post(url: str, model: str = "m") -> tuple[int, str, str]:
    headers = {contract.ACTIVATOR_MODEL_HEADER: model, contract.CLUSTER_HEADER: contract.ACTIVATOR_CLUSTER}
    async with aiohttp.ClientSession() as session, session.post(url, json=BODY, headers=headers) as response:
        return response.status, response.headers["content-type"], await response.text()


def events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


async def test_unknown_model_is_an_openai_404(served: tuple[Gateway, str, Backend]) -> None:
    _, url, _ = served
    status, content_type, text = await post(url, "nope")
    assert (status, content_type) == (404, "application/json")
    assert json.loads(text)["error"] == {
        "message": "model 'nope' does not exist",
        "type": "not_found_error",
        "code": "model_not_found",
    }


async def test_heartbeats_while_cold_then_the_backend_stream(served: tuple[Gateway, str, Backend]) -> None:
    gateway, url, backend = served
    reply = asyncio.create_task(post(url))
    await asyncio.sleep(0.3)
    assert gateway.cold.depth("m") == 1
    gateway.set_routes([route(("127.0.0.1", backend.port))])
    status, content_type, text = await asyncio.wait_for(reply, 5)
    assert (status, content_type) == (200, "text/event-stream")
    assert text.count(": keepalive") >= 2
    assert events(text) == ['{"piece": "Hello"}', '{"piece": "world"}', "[DONE]"]
    headers, body = backend.seen[0]
    assert body == BODY
    assert contract.ACTIVATOR_MODEL_HEADER not in {k.lower() for k in headers}
    assert contract.CLUSTER_HEADER not in {k.lower() for k in headers}
    assert gateway.in_flight == {}


async def test_a_failed_activation_ends_the_stream_with_an_error_event(served: tuple[Gateway, str, Backend]) -> None:
    gateway, url, _ = served
    reply = asyncio.create_task(post(url))
    await asyncio.sleep(0.1)
    gateway.set_routes([route(failed=1)])
    status, _, text = await asyncio.wait_for(reply, 5)
    assert status == 200
    error, done = events(text)
    assert json.loads(error)["error"]["code"] == "activation_failed"
    assert json.loads(error)["error"]["type"] == "service_unavailable"
    assert done == "[DONE]"


async def test_weights_that_cannot_be_had_end_the_stream_with_weights_unavailable(
    served: tuple[Gateway, str, Backend],
) -> None:
    gateway, url, _ = served
    reply = asyncio.create_task(post(url))
    await asyncio.sleep(0.1)
    failed = route(failed=1)
    failed.last_failure = "weights unavailable: oci://127.0.0.1:1/models/tiny:v1: not found"
    failed.failure_code = contract.WEIGHTS_UNAVAILABLE
    gateway.set_routes([failed])
    status, _, text = await asyncio.wait_for(reply, 5)
    assert status == 200
    error, done = events(text)
    body = json.loads(error)["error"]
    assert (body["code"], body["type"]) == ("weights_unavailable", "service_unavailable")
    assert body["message"] == "model 'm' cannot get its weights: " + failed.last_failure
    assert done == "[DONE]"


async def test_a_backend_error_after_the_200_is_an_error_event(served: tuple[Gateway, str, Backend]) -> None:
    gateway, url, backend = served
    backend.status = 500
    reply = asyncio.create_task(post(url))
    await asyncio.sleep(0.1)
    gateway.set_routes([route(("127.0.0.1", backend.port))])
    status, _, text = await asyncio.wait_for(reply, 5)
    assert status == 200
    error, done = events(text)
    assert json.loads(error)["error"]["code"] == "upstream_error" and done == "[DONE]"
    assert gateway.in_flight == {}
