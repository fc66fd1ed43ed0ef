"""Addresses and the HTTP admin surface of control processes: HOST:PORT parsing, free ports, /metrics."""

from __future__ import annotations

import random
import socket
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: Buckets of `wakegate_cold_start_seconds`, the same under `wakegate up` and the operator.
COLD_START_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 180, 300, 600)


#: Where `free_port` looks: above the well-known and registered services most machines run, and
#: below the kernel's ephemeral range (read at first use), which outgoing connections draw from.
PORT_FLOOR = 15000
#: Ports this process handed out lately: never handed out again while they are here.
_given: deque[int] = deque(maxlen=4096)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", offsets: Sequence[int] = ()) -> int:
    """A TCP port on `host` that nothing listens on right now (`wakegate up`'s children, tests).

    The caller binds it later (a child process, often a second or more later), so two things
    keep the port free until then: it is never one this process handed out lately (one `up` picks
    ports for its extprocs and then for its replicas before the extprocs have bound theirs), and
    it lies below the ephemeral range, where no outgoing connection's local port can take it.

    `offsets`: the child also binds port + each offset, on every interface (an engine's KV-events
    sockets, `routing.kvEvents.portOffset`); those are free too and handed out with the port, so
    no other child is given one of them.
    """
    extra = sorted({o for o in offsets if o})
    reach = max(extra, default=0)
    high = _ephemeral_low() - 1 - reach
    for _ in range(200) if high > PORT_FLOOR else ():
        port = random.randint(PORT_FLOOR, high)
        if _take(host, port, extra):
            return port
    while True:  # a machine whose ephemeral range leaves nothing below it: the kernel's choice
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port + reach <= 65535 and _take(host, port, extra):
            return port


def _take(host: str, port: int, offsets: Sequence[int]) -> bool:
    """Hand out `port` and port + each of `offsets` if none was handed out lately and all are free."""
    wanted = [port, *(port + o for o in offsets)]
    if any(p in _given for p in wanted):
        return False
    if not _bindable(host, port) or not all(_bindable("", p) for p in wanted[1:]):
        return False
    _given.extend(wanted)
    return True


def metrics_response(registry: CollectorRegistry) -> web.Response:
    return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def serve(routes: Mapping[str, Handler], host: str, port: int) -> web.AppRunner:
    """Serve GET `routes` on host:port until the returned runner is cleaned up."""
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_get(path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


class RefusalCounts(Protocol):
    """Anything that counts refused internal calls by service (an Authenticator, a feeder's report)."""

    @property
    def refused(self) -> Mapping[str, int]: ...


class RefusedCalls:
    """A Prometheus collector of the calls an internal-token check refused, by service (ads, demand)."""

    SERVICES = ("ads", "demand")

    def __init__(self, counts: RefusalCounts, services: tuple[str, ...] = SERVICES) -> None:
        self._authenticator = counts
        self._services = services

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "wakegate_internal_auth_refused",
            "Internal gRPC calls (ADS streams, demand reports) refused for a missing or wrong internal token.",
            labels=["service"],
        )
        for service in self._services:
            family.add_metric([service], self._authenticator.refused.get(service, 0))
        yield family
