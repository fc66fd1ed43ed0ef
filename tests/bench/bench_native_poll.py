"""What extproc's native-demand poll (`--envoy-admin`) costs: one poll of a real Envoy's admin API.

Run from the repository root (not collected by `pytest tests`):

    python -m tests.bench.bench_native_poll [--models 1 50 200] [--polls 400] [--without-usedonly]

Starts a real Envoy whose static clusters are named as the feeder names model clusters' stats
(`model_<ns>_<name>`), then runs `NativeCounts.poll` (the GET with the filtered stats query, the
JSON decode, the counter arithmetic) `--polls` times per model count, for a gateway whose every
model asks for the native path. Prints the median wall time of a poll, this process's CPU time
per poll (extproc's share) and Envoy's (from /proc: its admin thread filters every stat by the
query's regex), each also as the share of one core at the 0.25 s poll interval, with the load
average.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import yaml

from wakegate.control import bootstrap
from wakegate.control.admin import free_port
from wakegate.envoycounters import POLL_SECONDS, STATS_QUERY, stat_name
from wakegate.extproc import native
from wakegate.extproc.auth import ApiKeys
from wakegate.extproc.gateway import Gateway, Settings
from wakegate.extproc.native import NativeCounts
from wakegate.v1 import routing_pb2


def _address(port: int) -> dict[str, object]:
    return {"socket_address": {"address": "127.0.0.1", "port_value": port}}


def envoy_config(keys: list[str], admin: int, listen: int) -> dict[str, object]:
    """One cluster per model, each reached by `/<its stat name>/` on the listener; their one host is
    Envoy's own admin API, so a request through each writes its counters (as served models have)."""
    clusters = [
        {
            "name": stat_name(key),
            "type": "STATIC",
            "connect_timeout": "1s",
            "load_assignment": {
                "cluster_name": stat_name(key),
                "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(admin)}}]}],
            },
        }
        for key in keys
    ]
    routes = [
        {"match": {"prefix": f"/{stat_name(key)}/"}, "route": {"cluster": stat_name(key), "prefix_rewrite": "/ready"}}
        for key in keys
    ]
    manager = {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
            "HttpConnectionManager",
            "stat_prefix": "bench",
            "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}]},
            "http_filters": [
                {
                    "name": "envoy.filters.http.router",
                    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
                }
            ],
        },
    }
    listener = {"name": "bench", "address": _address(listen), "filter_chains": [{"filters": [manager]}]}
    return {
        "admin": {"address": _address(admin)},
        "static_resources": {"clusters": clusters, "listeners": [listener]},
    }


def start_envoy(keys: list[str], folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A ready Envoy whose every model cluster has served one request; its admin address."""
    admin, listen = free_port(), free_port()
    config = folder / f"envoy-{len(keys)}.yaml"
    config.write_text(yaml.safe_dump(envoy_config(keys, admin, listen)))
    envoy = subprocess.Popen(
        [bootstrap.envoy_binary(), "-c", str(config), "--use-dynamic-base-id", "--log-level", "error"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=1) as resp:
                ready = resp.status == 200
        except OSError:
            ready = False
        if ready:
            for key in keys:
                with urllib.request.urlopen(f"http://127.0.0.1:{listen}/{stat_name(key)}/", timeout=5) as resp:
                    resp.read()
            return envoy, f"127.0.0.1:{admin}"
        time.sleep(0.1)
    envoy.kill()
    raise RuntimeError("envoy did not start")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(address: str, keys: list[str], polls: int, envoy: int) -> tuple[float, float, float]:
    gateway = Gateway(Settings(), ApiKeys(None))
    gateway.set_routes(
        [
            routing_pb2.ModelRoute(key=key, names=[key], served_name=key, cluster=f"model.{key}", path="native")
            for key in keys
        ]
    )
    counts = NativeCounts(address, gateway)
    walls = []
    async with aiohttp.ClientSession(base_url=f"http://{address}") as session:
        await counts.poll(session, 0.0)
        cpu, envoy_cpu = time.process_time(), cpu_seconds(envoy)
        for i in range(polls):
            started = time.perf_counter()
            await counts.poll(session, float(i))
            walls.append(time.perf_counter() - started)
        cpu, envoy_cpu = time.process_time() - cpu, cpu_seconds(envoy) - envoy_cpu
    return statistics.median(walls), cpu / polls, envoy_cpu / polls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, nargs="+", default=[1, 50, 200])
    parser.add_argument("--polls", type=int, default=400)
    parser.add_argument(
        "--without-usedonly", action="store_true", help="the query without `usedonly` (what it saves, for comparison)"
    )
    args = parser.parse_args()
    if args.without_usedonly:
        native.STATS_QUERY = STATS_QUERY.replace("&usedonly", "")
    print(f"load before: {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.models:
            keys = [f"ns/m{i}" for i in range(n)]
            envoy, address = start_envoy(keys, Path(tmp))
            try:
                wall, cpu, envoy_cpu = asyncio.run(measure(address, keys, args.polls, envoy.pid))
            finally:
                envoy.kill()
                envoy.wait()
            print(
                f"{n:4d} models: poll {wall * 1e6:6.0f} us wall; CPU per poll: extproc {cpu * 1e6:5.0f} us "
                f"({cpu / POLL_SECONDS:.2%} of a core), "
                f"Envoy {envoy_cpu * 1e6:6.0f} us ({envoy_cpu / POLL_SECONDS:.2%})"
            )
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
