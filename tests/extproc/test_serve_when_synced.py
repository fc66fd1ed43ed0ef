"""A new extproc refuses Envoy's connections until it has a route table (extproc/main.py).

Envoy's ext_proc gRPC service retries a stream it cannot connect on the other extproc; a restarted
extproc that accepted streams before its first route table answered them `gateway_starting`
while the other one could have routed them (tests/reliability/test_faults.py saw it). These use
the real HTTP/2 server on loopback: the port is bound at once, and connections are refused, then
accepted once the table is here, or after a bounded wait when no feeder answers.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from wakegate.extproc import main
from wakegate.extproc.h2grpc.call import GrpcServer


def accepts(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except ConnectionRefusedError:
        return False
    return True


async def bound() -> tuple[GrpcServer, str]:
    server = GrpcServer({})
    return server, await server.listen("127.0.0.1:0", serving=False)


async def test_a_port_another_server_listens_on_is_refused_at_once() -> None:
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        with pytest.raises(OSError):
            await GrpcServer({}).listen(f"127.0.0.1:{taken.getsockname()[1]}", serving=False)
    finally:
        taken.close()


async def test_connections_are_refused_until_the_first_route_table_then_accepted() -> None:
    server, address = await bound()
    synced, stop, failed = asyncio.Event(), asyncio.Event(), []
    task = asyncio.create_task(main._serve_when_synced(server, address, synced, stop, failed))
    await asyncio.sleep(0.2)
    assert not accepts(address)
    synced.set()
    await asyncio.wait_for(task, 2)
    assert accepts(address) and not failed and not stop.is_set()
    await server.stop(0)


async def test_without_a_feeder_it_accepts_after_the_bounded_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(main, "UNSYNCED_SERVE_SECONDS", 0.3)
    server, address = await bound()
    synced, stop, failed = asyncio.Event(), asyncio.Event(), []
    task = asyncio.create_task(main._serve_when_synced(server, address, synced, stop, failed))
    await asyncio.sleep(0.1)
    assert not accepts(address)
    await asyncio.wait_for(task, 2)
    assert accepts(address) and not failed
    await server.stop(0)


async def test_a_stopping_extproc_never_starts_accepting() -> None:
    server, address = await bound()
    synced, stop, failed = asyncio.Event(), asyncio.Event(), []
    stop.set()
    synced.set()
    await main._serve_when_synced(server, address, synced, stop, failed)
    assert not accepts(address) and not failed
    await server.stop(0)
