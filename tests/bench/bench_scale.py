"""Scale: what a route change costs with many Models and endpoints, and `wakegate up` with many Models.

Run from the repository root (not collected by `pytest tests`):

    python -m tests.bench.bench_scale route [--models 1 10 100 1000] [--endpoints 10] [--changes 60]
    python -m tests.bench.bench_scale up [--models 1 1000] [--duration 8] [--connections 16] [--repeat 2]

`route`: the feeder's publisher and ADS server in this process (the code `wakegate up`'s and
`wakegate xds`'s feeders run), a real Envoy and a real extproc subscribed to it as one gateway.
For each fleet size N (every model with `--endpoints` endpoints on loopback addresses nobody
serves: no requests flow, so no connection is made to them) it measures:
  * start: from the first snapshot until Envoy has acknowledged every cluster's endpoints and
    extproc every route;
  * a route change: one endpoint of one model replaced (a replica became ready), timed from the
    publish until the feeder holds both acknowledgements, Envoy's EDS and then extproc's route
    (extproc gets an endpoint only once its Envoy has it, so this is the whole path);
  * what crossed the wire for it (resources and bytes) against the full state of each type;
  * the feeder's build time per change, and RSS of the feeder (this process), Envoy and extproc.

`up`: `wakegate up` with N sim Models (two at `min: 1`, the rest at `min: 0`), for each N:
time from start to "serving on" and every Model listed in `/v1/models`, RSS of every process
of the gateway, the wake of one Model at zero (time to its first answer), and the warm
request rate on one warm Model with CPU per request; the sizes alternate `--repeat` times so
drift on a shared machine hits them alike. It needs `wrk` for the rate (Debian's package).

Every process it starts is stopped on exit, Ctrl-C or error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

from tests.bench.common import git_state, loadavg
from tests.bench.procs import cmdline
from wakegate import internal_token
from wakegate.control import bootstrap
from wakegate.control.admin import free_port
from wakegate.control.feeder.ads import start_server
from wakegate.control.feeder.cache import SnapshotCache
from wakegate.control.feeder.envoy_types import CLUSTER, ENDPOINT, MODEL_ROUTE
from wakegate.control.feeder.publisher import Publisher
from wakegate.control.feeder.routed import RoutedModel
from wakegate.control.feeder.settings import GatewaySettings
from wakegate.internal_token import Authenticator, TokenSource

NODE = "bench-scale"


def rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree(pid: int) -> list[int]:
    """`pid` and every process below it."""
    out = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    with contextlib.suppress(OSError):
        for child in children.read_text().split():
            out += tree(int(child))
    return out


def cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return 0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# -- route changes -------------------------------------------------------------------------------


def fleet(models: int, endpoints: int, generation: int = 0) -> list[RoutedModel]:
    return [
        RoutedModel(
            key=f"bench/m{i}",
            names=(f"m{i}",),
            served_name=f"m{i}",
            endpoints=tuple((f"127.{1 + i // 250}.{i % 250}.{1 + j}", 8000 + generation) for j in range(endpoints)),
        )
        for i in range(models)
    ]


class Gateway:
    """A real Envoy and a real extproc, subscribed to this process's feeder as one gateway."""

    def __init__(self, tmp: Path, xds_port: int, token: Path) -> None:
        self.tmp = tmp
        extproc_port, activator, admin = free_port(), free_port(), free_port()
        ports = bootstrap.GatewayPorts(envoy_admin=free_port(), xds=xds_port, extproc=extproc_port, activator=activator)
        config = tmp / "envoy.yaml"
        config.write_text(bootstrap.render(NODE, ports, bootstrap.TokenRef(file=str(token))))
        self.listen = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Any] = []
        self._spawn(
            "envoy",
            [bootstrap.envoy_binary(), "-c", str(config), "--concurrency", "1", "--use-dynamic-base-id",
             "--log-level", "warn"],
        )  # fmt: skip
        self._spawn(
            "extproc",
            [sys.executable, "-m", "wakegate.extproc", "--listen", f"127.0.0.1:{extproc_port}",
             "--admin-listen", f"127.0.0.1:{admin}", "--activator-listen", f"127.0.0.1:{activator}",
             "--xds", f"127.0.0.1:{xds_port}", "--node-id", f"{NODE}-extproc", "--gateway-id", NODE,
             "--internal-token-file", str(token), "--log-level", "WARNING"],
        )  # fmt: skip

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = (self.tmp / f"{name}.log").open("wb")
        self.logs.append(log)
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def rss(self) -> dict[str, int]:
        return {name: rss_kb(p.pid) for name, p in zip(("envoy", "extproc"), self.procs, strict=True)}

    def stop(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, 15)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait()
        for log in self.logs:
            log.close()


async def route_run(models: int, endpoints: int, changes: int, tmp: Path) -> dict[str, Any]:
    state = fleet(models, endpoints)
    publisher = Publisher(SnapshotCache(), GatewaySettings(), lambda: state)
    acked = asyncio.Event()

    def on_acked() -> None:
        acked.set()
        publisher.publish_soon()

    token = internal_token.generate(tmp / "secrets" / "token")
    started = time.perf_counter()
    await publisher.publish()
    server, ads, port = await start_server(
        publisher.cache, "127.0.0.1:0", on_endpoints_acked=on_acked, authenticator=Authenticator(TokenSource(token))
    )
    publisher.ads = ads
    gateway = Gateway(tmp, port, token)

    def holds(cluster: str, endpoint: tuple[str, int]) -> bool:
        confirmed = ads.confirmed(NODE) or {}
        return endpoint in confirmed.get(cluster, ()) and endpoint in ads.retained(NODE).get(cluster, ())

    async def until(check: Any, timeout: float) -> None:
        deadline = time.perf_counter() + timeout
        while not check():
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise TimeoutError
            acked.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(acked.wait(), remaining)

    try:
        last = state[-1]
        first = state[0]
        await until(lambda: holds(last.cluster, last.endpoints[0]) and holds(first.cluster, first.endpoints[0]), 300)
        start_s = time.perf_counter() - started
        full = {
            kind: sum(len(m.SerializeToString()) for m in publisher.cache.snapshot.by_type[t].values())
            for kind, t in (("cds", CLUSTER), ("eds", ENDPOINT), ("routes", MODEL_ROUTE))
        }
        latencies, builds, resources, envoy_ms = [], [], [], []
        for n in range(changes):
            i = (n * 7919) % models
            old = state[i]
            ready = (f"127.200.{n // 250}.{1 + n % 250}", 9000)
            state[i] = replace(old, endpoints=(*old.endpoints[1:], ready))
            sent = ads.stats.resources_sent
            t0 = time.perf_counter()
            await publisher.publish()
            built = time.perf_counter() - t0
            await until(lambda c=old.cluster, e=ready: e in (ads.confirmed(NODE) or {}).get(c, ()), 30)
            envoy_ms.append((time.perf_counter() - t0) * 1000)
            await until(lambda c=old.cluster, e=ready: holds(c, e), 30)
            latencies.append((time.perf_counter() - t0) * 1000)
            builds.append(built * 1000)
            resources.append(ads.stats.resources_sent - sent)
        changed = state[(changes - 1) * 7919 % models]
        change_bytes = {
            "eds": len(publisher.cache.snapshot.by_type[ENDPOINT][changed.cluster].SerializeToString()),
            "route": len(publisher.cache.snapshot.by_type[MODEL_ROUTE][changed.key].SerializeToString()),
        }
        await asyncio.sleep(0.5)  # let the last acknowledgements settle before reading memory
        return {
            "models": models,
            "endpoints": models * endpoints,
            "start_s": round(start_s, 2),
            "change_ms_p50": round(statistics.median(latencies), 1),
            "change_ms_p99": round(percentile(latencies, 0.99), 1),
            "change_ms_max": round(max(latencies), 1),
            "envoy_ms_p50": round(statistics.median(envoy_ms), 1),
            "envoy_ms_p99": round(percentile(envoy_ms, 0.99), 1),
            "build_ms_p50": round(statistics.median(builds), 2),
            "resources_per_change_p50": statistics.median(resources),
            "change_bytes": change_bytes,
            "full_state_bytes": full,
            "rss_kb": {"feeder": rss_kb(os.getpid()), **gateway.rss()},
        }
    finally:
        gateway.stop()
        await server.stop(0)


def route_main(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for models in args.models:
        with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
            row = asyncio.run(route_run(models, args.endpoints, args.changes, Path(tmp)))
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    print(
        "| models | endpoints | start s | change p50 / p99 / max ms | build ms | resources sent "
        "| bytes (EDS + route) | full CDS / EDS / routes KB | RSS feeder / Envoy / extproc MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        rss = row["rss_kb"]
        full = row["full_state_bytes"]
        print(
            f"| {row['models']} | {row['endpoints']} | {row['start_s']} | {row['change_ms_p50']} / "
            f"{row['change_ms_p99']} / {row['change_ms_max']} | {row['build_ms_p50']} | "
            f"{row['resources_per_change_p50']:g} | {row['change_bytes']['eds']} + {row['change_bytes']['route']} | "
            f"{full['cds'] // 1024} / {full['eds'] // 1024} / {full['routes'] // 1024} | "
            f"{rss['feeder'] // 1024} / {rss['envoy'] // 1024} / {rss['extproc'] // 1024} |"
        )
    return rows


# -- wakegate up with many Models -----------------------------------------------------------------


def up_yaml(models: int) -> str:
    docs = []
    for i in range(models):
        warm = i < 2
        docs.append(
            "apiVersion: wakegate.io/v1alpha1\nkind: Model\n"
            f"metadata: {{name: m{i}}}\n"
            "spec:\n  backend: sim\n"
            f"  servedName: m{i}\n"
            "  routing: {strategy: round-robin}\n"
            f"  scaling: {{min: {1 if warm else 0}, max: 1, idleTimeout: 600, activationTimeout: 120}}\n"
        )
    return "---\n".join(docs)


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


class Up:
    def __init__(self, tmp: Path, models: int) -> None:
        self.tmp = tmp
        (tmp / "models.yaml").write_text(up_yaml(models))
        self.port, self.admin = free_port(), free_port()
        self.log = (tmp / "up.log").open("wb")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "wakegate", "up", "-f", str(tmp / "models.yaml"),
             "--listen", f"127.0.0.1:{self.port}", "--admin-listen", f"127.0.0.1:{self.admin}",
             "--state-dir", str(tmp / "state"), "--envoy-concurrency", "1", "--log-level", "WARNING"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"

    def serving(self) -> bool:
        return b"serving on" in (self.tmp / "up.log").read_bytes()

    def gateway_pids(self) -> dict[str, int]:
        """up, its feeder, Envoy and extprocs: the gateway (not the model servers)."""
        out = {}
        for pid in tree(self.proc.pid):
            line = cmdline(pid)
            if "wakegate sim" in line or " sim " in line:
                continue
            if "envoy" in line.split(" ")[0]:
                out["envoy"] = pid
            elif "up.feeder" in line:
                out["feeder"] = pid
            elif "wakegate.extproc" in line:
                out[f"extproc-{len([k for k in out if k.startswith('extproc')])}"] = pid
            elif pid == self.proc.pid:
                out["up"] = pid
        return out

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 15)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
        self.log.close()


def wrk_rate(wrk: str, url: str, model: str, duration: float, connections: int, tmp: Path) -> float:
    script = tmp / f"{model}.lua"
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
    script.write_text(
        f'wrk.method = "POST"\nwrk.body = {json.dumps(body)}\nwrk.headers["content-type"] = "application/json"\n'
    )
    done = subprocess.run(
        [wrk, "-t1", f"-c{connections}", f"-d{duration:g}s", "-s", str(script), f"{url}/v1/chat/completions"],
        capture_output=True, text=True, timeout=duration + 60, check=True,
    )  # fmt: skip
    non2xx = 0
    for line in done.stdout.splitlines():
        if "Non-2xx" in line:
            non2xx = int(line.split()[-1])
        if line.startswith("Requests/sec:"):
            rate = float(line.split()[1])
    if non2xx:
        raise RuntimeError(f"{non2xx} requests failed:\n{done.stdout}")
    return rate


def up_once(models: int, args: argparse.Namespace, wrk: str | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-scale-up-") as tmp_name:
        tmp = Path(tmp_name)
        up = Up(tmp, models)
        try:
            while not up.serving():
                if up.proc.poll() is not None:
                    log = (tmp / "up.log").read_text()[-3000:]
                    raise RuntimeError(f"wakegate up exited {up.proc.returncode}:\n{log}")
                if time.perf_counter() - up.started > args.timeout:
                    raise RuntimeError(f"not serving after {args.timeout} s")
                time.sleep(0.1)
            serving_s = time.perf_counter() - up.started
            while True:
                status, listing = http_json(f"{up.url}/v1/models")
                if status == 200 and len(listing["data"]) >= models:
                    break
                time.sleep(0.1)
            listed_s = time.perf_counter() - up.started
            hello = {"model": "m0", "messages": [{"role": "user", "content": "x"}]}
            while http_json(f"{up.url}/v1/chat/completions", hello)[0] != 200:
                time.sleep(0.1)
            row: dict[str, Any] = {
                "models": models,
                "serving_s": round(serving_s, 2),
                "all_listed_s": round(listed_s, 2),
                "listed": len(listing["data"]),
            }
            cold = f"m{models - 1}" if models > 2 else None
            if cold is not None:
                t0 = time.perf_counter()
                status, _ = http_json(
                    f"{up.url}/v1/chat/completions", {"model": cold, "messages": [{"role": "user", "content": "x"}]}
                )
                row["wake_s"] = round(time.perf_counter() - t0, 2)
                row["wake_status"] = status
            pids = up.gateway_pids()
            row["rss_kb"] = {name: rss_kb(pid) for name, pid in pids.items()}
            if wrk is not None:
                before = {name: cpu_ticks(pid) for name, pid in pids.items()}
                rate = wrk_rate(wrk, up.url, "m0", args.duration, args.connections, tmp)
                spent = sum(cpu_ticks(pid) - before[name] for name, pid in pids.items())
                row["rate"] = round(rate, 1)
                row["gateway_cpu_us_per_request"] = round(
                    spent / os.sysconf("SC_CLK_TCK") * 1e6 / max(1.0, rate * args.duration), 1
                )
            return row
        finally:
            up.stop()


def up_main(args: argparse.Namespace) -> list[dict[str, Any]]:
    wrk = shutil.which("wrk")
    if wrk is None:
        print("wrk not found (apt-get install wrk): request rates are skipped", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    for round_ in range(args.repeat):
        for models in args.models:
            row = up_once(models, args, wrk)
            row["round"] = round_
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print(
        "| models | serving s | all listed s | wake s | rate req/s | gateway CPU us/req "
        "| RSS up / feeder / Envoy / extprocs MB |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        rss = row["rss_kb"]
        extprocs = sum(v for k, v in rss.items() if k.startswith("extproc"))
        print(
            f"| {row['models']} | {row['serving_s']} | {row['all_listed_s']} | {row.get('wake_s', '-')} | "
            f"{row.get('rate', '-')} | {row.get('gateway_cpu_us_per_request', '-')} | "
            f"{rss.get('up', 0) // 1024} / {rss.get('feeder', 0) // 1024} / {rss.get('envoy', 0) // 1024} / "
            f"{extprocs // 1024} |"
        )
    if wrk is not None and len(args.models) > 1:
        by = {m: [row["rate"] for row in rows if row["models"] == m] for m in args.models}
        small, large = statistics.median(by[min(args.models)]), statistics.median(by[max(args.models)])
        print(f"\nwarm rate, {max(args.models)} Models vs {min(args.models)}: {large / small:.1%} (medians)")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench_scale", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="what", required=True)
    route = sub.add_parser("route")
    route.add_argument("--models", type=int, nargs="+", default=[1, 10, 100, 1000])
    route.add_argument("--endpoints", type=int, default=10, help="endpoints per model")
    route.add_argument("--changes", type=int, default=60)
    up = sub.add_parser("up")
    up.add_argument("--models", type=int, nargs="+", default=[1, 1000])
    up.add_argument("--duration", type=float, default=8.0)
    up.add_argument("--connections", type=int, default=16)
    up.add_argument("--repeat", type=int, default=2)
    up.add_argument("--timeout", type=float, default=300.0)
    for p in (route, up):
        p.add_argument("--json", type=Path, help="write the rows here too")
    args = parser.parse_args(argv)
    print("git:", git_state(), "load average before:", " ".join(f"{x:.1f}" for x in loadavg()), flush=True)
    rows = route_main(args) if args.what == "route" else up_main(args)
    print("load average after:", " ".join(f"{x:.1f}" for x in loadavg()))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
