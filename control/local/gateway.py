"""The local gateway as child processes: Envoy from the one bootstrap, its admin API, and the one
check of when the gateway serves. `wakegate up` and the federation's global gateway both run
Envoy in front of two extprocs (the active one and the standby, priorities 0 and 1 of Envoy's
extproc cluster) and wait for it the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import aiohttp

from wakegate import contract
from wakegate.control import bootstrap
from wakegate.control.local.children import Child, Supervised

#: Envoy's counter of listener updates it refused: a listener it cannot bind (the port was taken).
LISTENER_REJECTED = "listener_manager.lds.update_rejected"


class GatewayNotReady(Exception):
    """The gateway cannot serve: the message says why and where to look."""


def envoy(
    state_dir: Path,
    node_id: str,
    ports: bootstrap.GatewayPorts,
    token_file: Path | None,
    admin_socket: Path,
    *,
    concurrency: int = 1,
    extproc_streams: int | None = None,
) -> Supervised:
    """Envoy with its bootstrap written to `state_dir/envoy.yaml`, logging to `state_dir/logs`;
    restarted when it exits. `admin_socket`: where its admin API listens when `ports` names no
    admin port (a killed Envoy leaves the socket behind: it is cleared before each start)."""
    rendered = bootstrap.render(
        node_id, ports, bootstrap.TokenRef(file=str(token_file)), extproc_streams=extproc_streams
    )
    config = state_dir / "envoy.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(rendered, encoding="utf-8")
    argv = [
        bootstrap.envoy_binary(), "-c", str(config), "--concurrency", str(concurrency), "--use-dynamic-base-id",
        "--log-level", "warn", "--drain-time-s", "1", "--drain-strategy", "immediate",
    ]  # fmt: skip

    async def clear_socket() -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(admin_socket)

    return Supervised(Child("envoy", argv, state_dir / "logs" / "envoy.log"), before_start=clear_socket)


def admin_session(admin_listen: str | None, admin_socket: Path) -> aiohttp.ClientSession:
    """A client of Envoy's admin API (paths relative to it): on `admin_listen` (HOST:PORT) where
    one is given, else on its owner-only unix socket."""
    timeout = aiohttp.ClientTimeout(total=2)
    if admin_listen is None:
        connector = aiohttp.UnixConnector(path=str(admin_socket))
        return aiohttp.ClientSession(base_url="http://envoy", connector=connector, timeout=timeout)
    return aiohttp.ClientSession(base_url=f"http://{admin_listen}", timeout=timeout)


async def envoy_stat(session: aiohttp.ClientSession, name: str) -> int | None:
    """One of Envoy's stats by its exact name (0 while Envoy has none yet); None: no answer."""
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError, ValueError):
        async with session.get(f"/stats?filter=^{name}$&format=json") as response:
            stats = (await response.json()).get("stats", [])
            return int(stats[0]["value"]) if stats else 0
    return None


async def wait_ready(
    listen: tuple[str, int],
    extproc_admins: tuple[int, ...] | list[int],
    envoy_admin: aiohttp.ClientSession,
    stop: asyncio.Event,
    envoy_log: Path,
    *,
    timeout: float = 60.0,
    standby_grace: float = 10.0,
) -> bool:
    """Whether the gateway serves: a request would succeed. The active extproc has its routes
    (its /healthz), GET /healthz through Envoy and extproc answers 200, and Envoy's health checks
    see every extproc (until then its workers may still send some requests to the standby, whose
    rate-limit buckets and prefix history are its own; after `standby_grace` seconds of answering
    the active one is enough). False once `stop` is set. GatewayNotReady when Envoy refused the
    listener (the port was taken meanwhile) or `timeout` passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    answering_since: float | None = None
    healthy_stat = f"cluster.{contract.EXTPROC_CLUSTER}.membership_healthy"
    host, port = listen
    urls = [
        f"http://127.0.0.1:{extproc_admins[0]}/healthz",  # extproc has its route table
        f"http://{host}:{port}/healthz",  # through Envoy
    ]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as session:
        while loop.time() < deadline and not stop.is_set():
            ok = 0
            for url in urls:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                    async with session.get(url) as response:
                        ok += response.status == 200
            if ok == len(urls):
                now = loop.time()
                answering_since = now if answering_since is None else answering_since
                healthy = await envoy_stat(envoy_admin, healthy_stat)
                if (healthy or 0) >= len(extproc_admins) or now - answering_since >= standby_grace:
                    return True
            if await envoy_stat(envoy_admin, LISTENER_REJECTED):
                raise GatewayNotReady(f"Envoy cannot listen on {host}:{port} (see {envoy_log})")
            await asyncio.sleep(0.05)
    if stop.is_set():
        return False
    raise GatewayNotReady(f"gateway did not become ready in {timeout:.0f}s; see {envoy_log.parent}")
