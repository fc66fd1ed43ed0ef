"""extproc's admin HTTP port: /healthz and /metrics, open without auth."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from wakegate.extproc.gateway import Gateway


def make_app(gateway: Gateway, ready: Callable[[], bool]) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        if not ready():
            return web.json_response({"status": "starting"}, status=503)
        return web.json_response({"status": "ok", "models": len(gateway.table.routes)})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(gateway.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def queue(_: web.Request) -> web.Response:
        return web.json_response(gateway.queue_view())

    app = web.Application()
    app.router.add_get("/wakegate/queue", queue)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    return app


async def start(gateway: Gateway, ready: Callable[[], bool], host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(make_app(gateway, ready), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
