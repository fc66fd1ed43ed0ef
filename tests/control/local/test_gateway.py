"""The one readiness check of the local gateway (`up` and the federation's global gateway).

Envoy's side is a loopback stand-in serving its admin API's /stats JSON: the refused listener
cannot be brought about in a real Envoy on demand (the port must be taken between `up`'s own
bind check and Envoy's bind). The ready path through a real Envoy runs in every `up` test.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import web

from wakegate.contract import EXTPROC_CLUSTER
from wakegate.control.admin import free_port
from wakegate.control.local import gateway


async def _serve(stats: dict[str, int] | None = None) -> tuple[web.AppRunner, int]:
    """/healthz answering 200 (extproc's admin, Envoy's listener), or with `stats` Envoy's admin
    /stats: `{"stats": [...]}` for the exact name a filter asks for, 0 for any other."""

    async def handle(request: web.Request) -> web.StreamResponse:
        if stats is None:
            return web.Response(text="ok")
        name = request.query.get("filter", "").strip("^$")
        return web.json_response({"stats": [{"name": name, "value": stats.get(name, 0)}]})

    app = web.Application()
    app.router.add_get("/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


async def _check(stats: dict[str, int], tmp_path: Path, grace: float) -> bool:
    extproc, extproc_port = await _serve()
    listener, listener_port = await _serve()
    admin, admin_port = await _serve(stats)
    try:
        async with gateway.admin_session(f"127.0.0.1:{admin_port}", tmp_path / "unused.sock") as session:
            return await gateway.wait_ready(
                ("127.0.0.1", listener_port),
                (extproc_port, free_port()),
                session,
                asyncio.Event(),
                tmp_path / "logs" / "envoy.log",
                timeout=5.0,
                standby_grace=grace,
            )
    finally:
        for runner in (extproc, listener, admin):
            await runner.cleanup()


async def test_ready_once_envoy_sees_both_extprocs(tmp_path: Path) -> None:
    membership = f"cluster.{EXTPROC_CLUSTER}.membership_healthy"
    assert await _check({membership: 2}, tmp_path, grace=60.0)


async def test_the_active_extproc_alone_is_enough_after_the_standby_grace(tmp_path: Path) -> None:
    assert await _check({}, tmp_path, grace=0.2)


async def test_a_listener_envoy_refused_is_an_error_naming_the_address_and_the_log(tmp_path: Path) -> None:
    with pytest.raises(gateway.GatewayNotReady, match=r"Envoy cannot listen on 127\.0\.0\.1:\d+ \(see .*envoy\.log\)"):
        await _check({gateway.LISTENER_REJECTED: 1}, tmp_path, grace=60.0)


async def test_a_stop_while_waiting_is_not_ready_and_no_error(tmp_path: Path) -> None:
    stop = asyncio.Event()
    stop.set()
    async with gateway.admin_session("127.0.0.1:1", tmp_path / "unused.sock") as session:
        assert not await gateway.wait_ready(("127.0.0.1", 1), (1, 2), session, stop, tmp_path / "envoy.log")
