"""What Envoy's per-model bucket costs a native request: Envoy CPU per request, with and without.

Run from the repository root (not collected by `pytest tests`; needs `wrk` on PATH):

    python -m tests.bench.bench_native_ratelimit [--rounds 6] [--duration 3] [--connections 16]

Two Envoys (one worker each) on free loopback ports answer the same direct response to a POST
naming the model by `X-Model-ID`. One has only the router; the other has, before it, the local
rate limit and header mutation filters exactly as the feeder renders them for a rate-limited
native model, and the route carries the model's metadata, so every request draws a token (from a
bucket too large to refuse). wrk loads them in turn, `--rounds` times; the Envoy CPU each request
cost (from /proc) is printed per run, with the medians and their difference. A direct response
leaves out the upstream, so the difference is the filters' own cost.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from tests.bench.common import git_state, loadavg
from tests.bench.procs import CLK_TCK, proc_ticks
from tests.bench.wrk import lua_script, run_wrk
from wakegate.control.admin import free_port
from wakegate.control.bootstrap import envoy_binary
from wakegate.control.feeder import listeners
from wakegate.control.feeder.listeners import ROUTER_FILTER, http_listener
from wakegate.control.feeder.ratelimit import HEADER_MUTATION, LOCAL_RATE_LIMIT
from wakegate.control.feeder.routed import RoutedModel
from wakegate.control.feeder.routes import route_configuration
from wakegate.control.feeder.settings import GatewaySettings

MODEL = RoutedModel(
    key="bench", names=("bench",), served_name="bench", strategy="round-robin", path="native",
    endpoints=(("127.0.0.1", 9),), requests_per_second=1e9, burst=1e9,
)  # fmt: skip
SETTINGS = GatewaySettings(native_allowed=True)


def bootstrap(port: int, admin: int, limited: bool) -> dict[str, Any]:
    """One listener: a direct response for `X-Model-ID: bench`, with the feeder's filters and the
    native route's metadata when `limited`."""
    route: dict[str, Any] = {
        "match": {"prefix": "/", "headers": [{"name": "x-model-id", "string_match": {"exact": "bench"}}]},
        "direct_response": {"status": 200, "body": {"inline_string": "ok"}},
    }
    filters = [ROUTER_FILTER]
    if limited:
        made = listeners.listener(SETTINGS, True, (MODEL,))
        listener = json_format.MessageToDict(made, preserving_proto_field_name=True)
        chain = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
        filters = [f for f in chain if f["name"] in (LOCAL_RATE_LIMIT, HEADER_MUTATION)] + filters
        table = route_configuration(SETTINGS, [MODEL], body_metadata=True, rate_limited=[MODEL])
        native = next(x for x in table.virtual_hosts[0].routes if x.route.cluster)
        route["metadata"] = json_format.MessageToDict(native.metadata, preserving_proto_field_name=True)
    hosts = [{"name": "all", "domains": ["*"], "routes": [route]}]
    hcm = {"stat_prefix": "bench", "route_config": {"virtual_hosts": hosts}, "http_filters": filters}
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {"listeners": [http_listener("bench", "127.0.0.1", port, hcm)]},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tests.bench.bench_native_ratelimit", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--rounds", type=int, default=6, help="runs per variant, alternating (default 6)")
    ap.add_argument("--duration", type=float, default=3.0, help="seconds per wrk run (default 3)")
    ap.add_argument("--connections", type=int, default=16, help="wrk connections (default 16)")
    args = ap.parse_args(argv)
    wrk = shutil.which("wrk")
    if wrk is None:
        print("wrk not found on PATH", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="wakegate-bench-rl-"))
    procs: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    admins: dict[str, int] = {}
    print(f"load average before: {loadavg()}  code: {git_state()}", flush=True)
    try:
        for name, limited in (("router only", False), ("with the bucket", True)):
            port, admin = free_port(), free_port()
            admins[name] = admin
            config = tmp / f"{limited}.json"
            config.write_text(json.dumps(bootstrap(port, admin, limited)))
            argv = [envoy_binary(), "-c", str(config), "--concurrency", "1", "--use-dynamic-base-id", "-l", "error"]
            procs[name] = (
                subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT),
                f"http://127.0.0.1:{port}/",
            )
            deadline = time.monotonic() + 20
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        script = lua_script(tmp, "post.lua", {"X-Model-ID": "bench"}, '{"model":"bench"}')
        costs: dict[str, list[float]] = {name: [] for name in procs}
        for round_ in range(args.rounds):
            for name, (proc, url) in procs.items():
                before = proc_ticks(proc.pid) or 0
                out, _ = run_wrk(wrk, url, script, args.connections, args.duration, latency=False)
                used = (proc_ticks(proc.pid) or 0) - before
                requests = int(next(line for line in out.splitlines() if "requests in" in line).split()[0])
                costs[name].append(used / CLK_TCK * 1e6 / requests)
                print(f"  round {round_ + 1} {name:<16} {requests / args.duration:>8.0f} req/s  "
                      f"{costs[name][-1]:6.1f} us Envoy CPU/req  load {loadavg()[0]}", flush=True)  # fmt: skip
        stats = f"http://127.0.0.1:{admins['with the bucket']}/stats?filter=http_local_rate_limit.ok$"
        with urllib.request.urlopen(stats, timeout=5) as reply:
            print(f"tokens taken (Envoy's stats): {reply.read().decode().strip()}")
        medians = {name: statistics.median(values) for name, values in costs.items()}
        for name, value in medians.items():
            print(f"median {name:<16} {value:6.1f} us/req")
        print(f"the bucket costs {medians['with the bucket'] - medians['router only']:+.1f} us per request")
    finally:
        for proc, _ in procs.values():
            proc.terminate()
            proc.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
