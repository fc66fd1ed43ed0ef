"""The activator: holds streaming requests for a cold model with SSE heartbeats, then streams the answer.

extproc routes a cold `stream: true` request of a `keepalive` model here (the
`wakegate_activator` cluster) after auth, limits and the body rewrite. The
activator answers 200 `text/event-stream` at once, writes `: keepalive`
comments while the model loads (so clients and proxies keep the connection),
and when the model is ready forwards the request to a picked endpoint and
streams the backend's events through unchanged. Failures after the 200 are
reported as an SSE `error` event followed by `[DONE]`. It listens on loopback
only; Envoy is its only client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import aiohttp
from aiohttp import web

from wakegate import contract
from wakegate.extproc.cold import ActivationFailed, ActivationTimeout, QueueFull
from wakegate.extproc.gateway import Gateway
from wakegate.extproc.responses import error_body

log = logging.getLogger("wakegate.extproc.activator")

_HOP_HEADERS = {
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "te",
    "upgrade",
    contract.ACTIVATOR_MODEL_HEADER,
    contract.CLUSTER_HEADER,
    contract.DESTINATION_HEADER,
    "x-envoy-expected-rq-timeout-ms",
    "x-forwarded-proto",
    "x-request-id",
}


def _event(code: str, message: str) -> bytes:
    """An error after the 200 went out: one SSE event with the gateway's error shape, then [DONE]."""
    return b"data: " + error_body(503, code, message) + b"\n\ndata: [DONE]\n\n"


class Activator:
    def __init__(self, gateway: Gateway, heartbeat_seconds: float = 2.0) -> None:
        self.gw = gateway
        self.heartbeat = heartbeat_seconds
        self._session: aiohttp.ClientSession | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        key = request.headers.get(contract.ACTIVATOR_MODEL_HEADER, "")
        route = self.gw.table.routes.get(key)
        if route is None:
            body = error_body(404, "model_not_found", f"model {key!r} does not exist")
            return web.Response(body=body, status=404, content_type="application/json")
        body = await request.read()
        started = time.monotonic()
        deadline = started + route.cold.activation_timeout_ms / 1000
        response = web.StreamResponse(
            status=200, headers={"content-type": "text/event-stream", "cache-control": "no-cache"}
        )
        await response.prepare(request)
        self.gw.metrics.queue_depth.labels(key).inc()
        waiter = asyncio.ensure_future(self.gw.cold.wait(route, deadline))
        try:
            while True:
                done, _ = await asyncio.wait({waiter}, timeout=self.heartbeat)
                if done:
                    break
                await response.write(b": keepalive\n\n")
            waiter.result()
        except QueueFull:
            await response.write(_event("queue_full", f"too many requests waiting for model {key!r}"))
            return response
        except ActivationTimeout:
            await response.write(
                _event(
                    "activation_timeout",
                    f"model {key!r} did not become ready within {route.cold.activation_timeout_ms // 1000}s",
                )
            )
            return response
        except ActivationFailed as exc:
            await response.write(_event(exc.code, exc.answer(key)))
            return response
        finally:
            self.gw.metrics.queue_depth.labels(key).dec()
            if not waiter.done():
                waiter.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await waiter
        await self._forward(request, response, key, body)
        return response

    async def _forward(self, request: web.Request, response: web.StreamResponse, key: str, body: bytes) -> None:
        route = self.gw.table.routes.get(key)
        if route is None or not route.endpoints:
            await response.write(_event("model_not_ready", f"model {key!r} is not ready"))
            return
        endpoints = [f"{e.address}:{e.port}" for e in route.endpoints]
        endpoint = self.gw.picker.pick(key, "least-loaded", endpoints, {}, None) or endpoints[0]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        self.gw.routed(key, endpoint)
        try:
            session = self._client()
            async with session.request(
                request.method, f"http://{endpoint}{request.path_qs}", data=body, headers=headers
            ) as upstream:
                if upstream.status != 200:
                    detail = (await upstream.read())[:2048].decode("utf-8", "replace")
                    await response.write(_event("upstream_error", f"backend answered {upstream.status}: {detail}"))
                    return
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
        except aiohttp.ClientError as exc:
            await response.write(_event("upstream_unavailable", f"backend connection failed: {exc}"))
        finally:
            self.gw.finished(key, endpoint)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


async def start(activator: Activator, host: str, port: int) -> web.AppRunner:
    app = web.Application(client_max_size=activator.gw.settings.max_body_bytes + 1024)
    app.router.add_route("*", "/{tail:.*}", activator.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
