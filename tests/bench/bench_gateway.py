"""Gateway overhead benchmark: client -> sim, client -> plain Envoy -> sim, client -> wakegate -> sim.

Run from the repository root (not collected by `pytest tests`):

    python -m tests.bench.bench_gateway [--duration 10] [--connections 16,32,64] [--envoy-concurrency 2]
                                        [--repeat 1] [--json OUT]

It starts, on free loopback ports and in a temporary directory:

* one `wakegate sim` (served name `bench-model`, no TTFT, no token rate) for the direct and
  plain-Envoy paths;
* one plain Envoy (static bootstrap: one listener, HttpConnectionManager with only the router
  filter, one STATIC cluster pointing at that sim), same `--concurrency` as wakegate's Envoy;
* one `wakegate up` with two sim-backed models (min = max = 1 each): `bench-model` on the decided
  path (extproc decides every request) and `bench-native` with `routing.path: native` (Envoy
  routes its warm requests alone).

Then, for every path, wrk (one thread) POSTs a small chat completion: throughput runs at each of
`--connections` and a latency run at one connection. A path's throughput is its best rate over
the connection counts (a path with a side call needs more requests in flight to keep the CPUs
busy); the ratios at each fixed count are printed as well. Each wakegate model is measured twice:
model only in the JSON body (the decided model: extproc asks Envoy to buffer the body, the usual
OpenAI-client case; the native model: Envoy's json_to_metadata reads it) and model in the
`X-Model-ID` header (no body buffering). It prints a table, the ratios against plain Envoy and
the added p50 latency at one connection, the load average before and after, and the CPU each
process used during each run (from /proc), including CPU used by processes this benchmark did
not start (other load on the machine).

Every process it started is stopped on exit, Ctrl-C or error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tests.bench.common import git_state, loadavg
from tests.bench.procs import CpuMeter, Proc, children_of, cmdline, http, wait_until
from tests.bench.wrk import MODEL, WrkResult, chat_body, lua_script, parse_wrk, run_wrk
from wakegate.control.admin import free_port
from wakegate.control.bootstrap import envoy_binary

#: The same sim model on the native path (routing.path native, strategy round-robin).
NATIVE = "bench-native"

NATIVE_BODY = chat_body(NATIVE)
#: The wakegate paths: (name, model, named by the X-Model-ID header).
WAKEGATE_PATHS = (
    ("wakegate(body)", MODEL, False),
    ("wakegate(X-Model-ID)", MODEL, True),
    ("native(body)", NATIVE, False),
    ("native(X-Model-ID)", NATIVE, True),
)


# -- the three stacks ---------------------------------------------------------------------------


HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ENVOY_BOOTSTRAP = """\
admin:
  address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin_port} }} }}
static_resources:
  listeners:
    - name: bench
      address: {{ socket_address: {{ address: 127.0.0.1, port_value: {port} }} }}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": {hcm_type}
                stat_prefix: bench
                codec_type: AUTO
                route_config:
                  name: bench
                  virtual_hosts:
                    - name: all
                      domains: ["*"]
                      routes:
                        - match: {{ prefix: "/" }}
                          route: {{ cluster: sim, timeout: 0s }}
                http_filters:
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
    - name: sim
      type: STATIC
      connect_timeout: 1s
      load_assignment:
        cluster_name: sim
        endpoints:
          - lb_endpoints:
              - endpoint:
                  address: {{ socket_address: {{ address: 127.0.0.1, port_value: {sim_port} }} }}
"""

def models_yaml(native_limit: float = 0.0) -> str:
    """The two models; `native_limit` > 0 gives bench-native a per-model rate limit that high
    (burst the same), kept by Envoy's local rate limit (its cost on the native path); bench-native is
    the last document, so the limit is appended to its spec."""
    if native_limit <= 0:
        return MODELS_YAML
    return MODELS_YAML + f"  limits: {{requestsPerSecond: {native_limit}, burst: {native_limit}}}\n"


MODELS_YAML = f"""\
apiVersion: wakegate.io/v1alpha1
kind: Model
metadata:
  name: {MODEL}
spec:
  backend: sim
  scaling: {{min: 1, max: 1}}
  args: []
---
apiVersion: wakegate.io/v1alpha1
kind: Model
metadata:
  name: {NATIVE}
spec:
  backend: sim
  scaling: {{min: 1, max: 1}}
  routing: {{strategy: round-robin, path: native}}
  args: []
"""


class Stacks:
    def __init__(self, tmp: Path, envoy_concurrency: int, native_limit: float = 0.0, same_sim: bool = False) -> None:
        self.tmp = tmp
        self.concurrency = envoy_concurrency
        self.native_limit = native_limit
        #: The direct and plain-Envoy paths go to bench-native's own replica (the process behind the
        #: native path) instead of a sim of their own, so those three paths share one backend.
        self.same_sim = same_sim
        #: The model the direct and plain-Envoy paths name (the one their sim serves).
        self.plain_model = NATIVE if same_sim else MODEL
        self.procs: list[Proc] = []
        self.cpu_pids: dict[str, int] = {}

    def _spawn(self, name: str, argv: list[str]) -> Proc:
        p = Proc(name, argv, self.tmp / f"{name}.log", cwd=self.tmp)
        self.procs.append(p)
        return p

    def _start_plain_envoy(self) -> tuple[Proc, int]:
        """Plain Envoy in front of `sim_port`; returns it and its admin port."""
        self.envoy_port, envoy_admin = free_port(), free_port()
        config = self.tmp / "plain-envoy.yaml"
        config.write_text(
            ENVOY_BOOTSTRAP.format(
                admin_port=envoy_admin, port=self.envoy_port, sim_port=self.sim_port, hcm_type=HCM_TYPE
            )
        )
        envoy = self._spawn(
            "plain-envoy",
            [envoy_binary(), "-c", str(config), "--concurrency", str(self.concurrency),
             "--use-dynamic-base-id", "--log-level", "warn"],
        )  # fmt: skip
        self.envoy_url = f"http://127.0.0.1:{self.envoy_port}"
        return envoy, envoy_admin

    def start(self) -> None:
        py = sys.executable
        sim: Proc | None = None
        if not self.same_sim:
            # 1. the sim for the direct and plain-Envoy paths
            self.sim_port = free_port()
            sim = self._spawn(
                "sim",
                [py, "-m", "wakegate", "sim", "--host", "127.0.0.1", "--port", str(self.sim_port),
                 "--served-model-name", MODEL],
            )  # fmt: skip
            self.direct_url = f"http://127.0.0.1:{self.sim_port}"
            # 2. plain Envoy
            envoy, envoy_admin = self._start_plain_envoy()
        # 3. wakegate up
        models = self.tmp / "models.yaml"
        models.write_text(models_yaml(self.native_limit))
        self.wg_port, self.wg_admin = free_port(), free_port()
        up = self._spawn(
            "wakegate-up",
            [py, "-m", "wakegate", "up", "-f", str(models), "--listen", f"127.0.0.1:{self.wg_port}",
             "--admin-listen", f"127.0.0.1:{self.wg_admin}", "--state-dir", str(self.tmp / "state"),
             "--envoy-concurrency", str(self.concurrency), "--log-level", "WARNING"],
        )  # fmt: skip
        self.up = up
        self.wg_url = f"http://127.0.0.1:{self.wg_port}"

        def wg_ready() -> bool:
            status = json.loads(http(f"http://127.0.0.1:{self.wg_admin}/status")[1])
            ready = {m["key"]: m["ready"] for m in status["models"]}
            self.wg_status = status
            paths = {m["key"]: m.get("routingPath") for m in status["models"]}
            return (
                ready.get(MODEL) == 1
                and ready.get(NATIVE) == 1
                and paths.get(NATIVE) == "native"
                and "serving on" in up.log(100_000)
            )

        wait_until(wg_ready, "wakegate up: model ready and 'serving on'", 90, [up])
        if self.same_sim:
            (native,) = [m for m in self.wg_status["models"] if m["key"] == NATIVE]
            (self.sim_port,) = [r["port"] for r in native["replicas"] if r["state"] == "ready"]
            self.direct_url = f"http://127.0.0.1:{self.sim_port}"
            envoy, envoy_admin = self._start_plain_envoy()
        wait_until(lambda: http(self.direct_url + "/health")[0] == 200, "sim /health", 30, [sim or up])
        wait_until(lambda: http(f"http://127.0.0.1:{envoy_admin}/ready")[0] == 200, "plain Envoy /ready", 30, [envoy])

        # CPU accounting: our direct children and wakegate's children (Envoy, extproc, sim replica);
        # with same_sim the direct path's sim is wg-sim-native, counted once under that name.
        self.cpu_pids = {"plain-envoy": envoy.pid, "wg-up": up.pid}
        if sim is not None:
            self.cpu_pids["sim(direct)"] = sim.pid
        for pid in children_of(up.pid):
            cmd = cmdline(pid)
            if "envoy" in cmd.split(" ", 1)[0]:
                self.cpu_pids["wg-envoy"] = pid
            elif ("-m wakegate.extproc" in cmd or "-m extproc" in cmd) and "extproc-1" not in cmd:
                self.cpu_pids["wg-extproc"] = pid  # the active one
            elif "-m wakegate.extproc" in cmd:
                self.cpu_pids["wg-standby"] = pid  # the standby extproc: it reads every access-log entry too
            elif "wakegate.control.up.feeder" in cmd:
                self.cpu_pids["wg-feeder"] = pid
            elif " sim " in cmd and NATIVE in cmd:
                self.cpu_pids["wg-sim-native"] = pid
            elif " sim " in cmd:
                self.cpu_pids["wg-sim"] = pid
        missing = {"wg-envoy", "wg-extproc", "wg-sim"} - set(self.cpu_pids)
        if missing:
            print(f"note: could not find {sorted(missing)} among wakegate up's children", file=sys.stderr)

    def check_responses(self) -> None:
        """One request per path before measuring: 200 and a chat completion for bench-model."""
        checks = {
            "direct": (self.direct_url, {}, self.plain_model),
            "plain-envoy": (self.envoy_url, {}, self.plain_model),
            **{
                name: (self.wg_url, {"X-Model-ID": model} if by_header else {}, model)
                for name, model, by_header in WAKEGATE_PATHS
            },
        }
        for name, (base, extra, model) in checks.items():
            status, body = http(
                base + "/v1/chat/completions", chat_body(model), {"Content-Type": "application/json", **extra}
            )
            if status != 200:
                raise RuntimeError(f"{name}: POST /v1/chat/completions -> {status}: {body[:500]!r}")
            doc = json.loads(body)
            if doc.get("model") != model or not doc.get("choices"):
                raise RuntimeError(f"{name}: unexpected response {body[:500]!r}")

    def stop(self) -> None:
        # wakegate up drains and stops its own children on SIGTERM; signal only the leader first.
        for p in reversed(self.procs):
            try:
                p.stop(30.0 if p is getattr(self, "up", None) else 10.0, group_term=p.name != "wakegate-up")
            except Exception as exc:  # keep stopping the others
                print(f"warning: stopping {p.name}: {exc}", file=sys.stderr)
        # wakegate's children have PDEATHSIG and their own sessions; make sure none is left.
        for name, pid in self.cpu_pids.items():
            if name.startswith("wg-") and name != "wg-up":
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, 0)
                    print(f"warning: {name} pid {pid} still running after stop; killing", file=sys.stderr)
                    os.killpg(pid, signal.SIGKILL)


# -- reporting ----------------------------------------------------------------------------------


def median_result(runs: list[WrkResult]) -> dict[str, Any]:
    first = runs[0]
    return {
        "path": first.path,
        "connections": first.connections,
        "rps": round(statistics.median(r.rps for r in runs), 1),
        "p50_ms": round(statistics.median(r.p50_ms for r in runs), 3),
        "p99_ms": round(statistics.median(r.p99_ms for r in runs), 3),
        "errors": sum(r.errors for r in runs),
        "cpu_us_per_req": round(statistics.median(r.cpu_us_per_request for r in runs), 1),
        "other_load_pct": round(statistics.median(r.cpu.get("other_load", 0.0) for r in runs), 1),
        "runs": len(runs),
    }


def fmt_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'path':<22} {'conns':>5} {'req/s':>10} {'p50 ms':>9} {'p99 ms':>9} {'errors':>7}"
        f" {'CPU us/req':>11} {'other load %':>13}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        flag = "" if r["errors"] == 0 else "  <-- ERRORS"
        lines.append(
            f"{r['path']:<22} {r['connections']:>5} {r['rps']:>10.0f} {r['p50_ms']:>9.3f} "
            f"{r['p99_ms']:>9.3f} {r['errors']:>7} {r['cpu_us_per_req']:>11.0f} "
            f"{r['other_load_pct']:>13.0f}{flag}"
        )
    return "\n".join(lines)


def fmt_cpu(results: list[WrkResult]) -> str:
    names = ["wrk", "sim(direct)", "plain-envoy", "wg-envoy", "wg-extproc", "wg-standby", "wg-feeder", "wg-sim"]
    names += ["wg-sim-native"]
    names += ["wg-up", "other_load"]
    head = f"{'run':<28}" + "".join(f"{n:>12}" for n in names) + f"{'machine':>10}"
    lines = [head, "-" * len(head)]
    for r in results:
        cells = "".join(f"{r.cpu.get(n, float('nan')):>12.0f}" for n in names)
        lines.append(f"{r.path + ' c' + str(r.connections):<28}{cells}{r.cpu.get('machine_busy', 0):>10.0f}")
    return "\n".join(lines)


def _conn_list(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None
    if not counts or min(counts) < 2:
        raise argparse.ArgumentTypeError("throughput runs need at least 2 connections each")
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.bench_gateway", description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per wrk run (default 10)")
    ap.add_argument(
        "--connections",
        type=_conn_list,
        default=(16, 32, 64),
        help="comma-separated connection counts for the throughput runs (default 16,32,64); each path's"
        " throughput is its best over these",
    )
    ap.add_argument(
        "--envoy-concurrency", type=int, default=2, help="worker threads of both Envoys (default 2, as wakegate up)"
    )
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of unmeasured load per path first")
    ap.add_argument("--repeat", type=int, default=1, help="rounds over all paths; the table shows medians")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here as JSON")
    ap.add_argument("--keep-tmp", action="store_true", help="keep the temp dir (logs, configs)")
    ap.add_argument(
        "--same-sim",
        action="store_true",
        help="send the direct and plain-Envoy paths to bench-native's own replica (the process behind the"
        " native path) instead of a sim of their own, so only the gateway differs between those paths",
    )
    ap.add_argument(
        "--native-limit",
        type=float,
        default=0.0,
        help="give bench-native a rate limit of this many requests/s (burst the same; 0: none), never"
        " reached at these rates: what Envoy's bucket costs a native request",
    )
    args = ap.parse_args(argv)

    wrk = shutil.which("wrk")
    if wrk is None:
        print("wrk not found on PATH", file=sys.stderr)
        return 2

    def on_term(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)

    tmp = Path(tempfile.mkdtemp(prefix="wakegate-bench-"))
    stacks = Stacks(tmp, args.envoy_concurrency, args.native_limit, args.same_sim)
    failed = True
    load_before = loadavg()
    code = git_state()
    started = time.time()
    results: list[WrkResult] = []
    try:
        print(f"load average before: {load_before}  (cpus: {os.cpu_count()})", flush=True)
        print(f"starting sim, plain Envoy and wakegate up in {tmp} ...", flush=True)
        stacks.start()
        stacks.check_responses()
        post = lua_script(tmp, "post.lua", {}, chat_body(stacks.plain_model))
        url = "/v1/chat/completions"
        paths = [
            ("direct", stacks.direct_url + url, post),
            ("plain-envoy", stacks.envoy_url + url, post),
            *(
                (
                    name,
                    stacks.wg_url + url,
                    lua_script(tmp, f"post{i}.lua", {"X-Model-ID": model} if by_header else {}, chat_body(model)),
                )
                for i, (name, model, by_header) in enumerate(WAKEGATE_PATHS)
            ),
        ]
        meter = CpuMeter(stacks.cpu_pids)
        for _round in range(args.repeat):
            for conns in (*args.connections, 1):
                for name, target, script in paths:
                    if _round == 0 and conns == args.connections[0] and args.warmup > 0:
                        run_wrk(wrk, target, script, conns, args.warmup, latency=False)
                    meter.start()
                    out, wrk_ticks = run_wrk(wrk, target, script, conns, args.duration)
                    result = parse_wrk(name, conns, args.duration, out)
                    result.cpu = meter.stop(wrk_ticks)
                    result.load_after = loadavg()
                    results.append(result)
                    flag = (
                        ""
                        if result.errors == 0
                        else f"  ERRORS: non-2xx={result.non_2xx} socket={result.socket_errors}"
                    )
                    print(
                        f"  {name:<22} c={conns:<3} {result.rps:>9.0f} req/s  p50 {result.p50_ms:.3f} ms  "
                        f"p99 {result.p99_ms:.3f} ms  load {result.load_after[0]:.2f}{flag}",
                        flush=True,
                    )
        failed = False
    except KeyboardInterrupt:
        print("\ninterrupted; stopping everything", file=sys.stderr)
        return 130
    finally:
        stacks.stop()
        if failed or args.keep_tmp:
            print(f"logs and configs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    load_after = loadavg()

    wakegate_names = tuple(name for name, _, _ in WAKEGATE_PATHS)
    names = ("direct", "plain-envoy", *wakegate_names)
    rows = []
    for conns in (*args.connections, 1):
        for name in names:
            runs = [r for r in results if r.path == name and r.connections == conns]
            rows.append(median_result(runs))
    by = {(r["path"], r["connections"]): r for r in rows}
    # Throughput is what a path sustains at its best concurrency: a path with a side call needs
    # more requests in flight to keep the CPUs busy (Little's law), so each path gets the best
    # of the connection counts; the ratios at each fixed count are printed too.
    peak = {name: max(by[(name, c)]["rps"] for c in args.connections) for name in names}
    peak_conns = {name: max(args.connections, key=lambda c, n=name: by[(n, c)]["rps"]) for name in names}
    ratios = {f"{name}/plain-envoy rps": peak[name] / peak["plain-envoy"] for name in wakegate_names}
    ratios["plain-envoy/direct rps"] = peak["plain-envoy"] / peak["direct"]
    fixed = {
        c: {f"{name}/plain-envoy rps": by[(name, c)]["rps"] / by[("plain-envoy", c)]["rps"] for name in wakegate_names}
        for c in args.connections
    }
    added = {}
    for variant in (*wakegate_names, "plain-envoy"):
        for base in ("plain-envoy", "direct"):
            if variant != base:
                added[f"{variant} - {base}"] = by[(variant, 1)]["p50_ms"] - by[(base, 1)]["p50_ms"]
    errors = sum(r.errors for r in results)

    print()
    print(
        f"wakegate gateway benchmark: {platform.node()} {os.cpu_count()} cpus, envoy concurrency "
        f"{args.envoy_concurrency}, wrk -t1, {args.duration:g}s per run, repeat {args.repeat}"
        + (" (medians)" if args.repeat > 1 else "")
        + (", direct and plain Envoy on bench-native's replica (--same-sim)" if args.same_sim else "")
    )
    print(f"code: git HEAD {code['head']}, uncommitted gateway changes: {code['worktree_changes']}")
    print(f"load average before {load_before}, after {load_after} (1/5/15 min)")
    print()
    print(fmt_table(rows))
    print(
        "CPU us/req: CPU time of the processes on the path (wrk, Envoy, extproc, sim) per request;"
        " other load %: CPU used by\nprocesses this benchmark did not start, in % of one core"
        " (both medians over runs)."
    )
    print()
    print("peak throughput (each path at its best connection count):")
    for name in names:
        print(f"  {name:<40} {peak[name]:8.0f} req/s at c={peak_conns[name]}")
    for k, v in ratios.items():
        print(f"  {k:<40} {v:6.1%}")
    for c, by_c in fixed.items():
        print(f"throughput ratios at a fixed {c} connections:")
        for k, v in by_c.items():
            print(f"  {k:<40} {v:6.1%}")
    print("added p50 latency at 1 connection:")
    for k, v in added.items():
        print(f"  {k:<40} {v * 1000:+8.0f} us")
    t_rps = min(ratios["wakegate(body)/plain-envoy rps"], ratios["wakegate(X-Model-ID)/plain-envoy rps"])
    t_native = min(ratios["native(body)/plain-envoy rps"], ratios["native(X-Model-ID)/plain-envoy rps"])
    t_lat = max(added[f"{name} - direct"] for name in wakegate_names)
    print("targets:")
    print(
        f"  decided: peak throughput >= 40% of plain Envoy's (worse variant): {t_rps:.1%}"
        f" -> {'MET' if t_rps >= 0.4 else 'MISSED'}"
    )
    print(
        f"  native: peak throughput >= 80% of plain Envoy's (worse variant): {t_native:.1%}"
        f" -> {'MET' if t_native >= 0.8 else 'MISSED'}"
    )
    print(f"  p50 added < 1 ms at c1 vs direct (worse variant): {t_lat:.3f} ms -> {'MET' if t_lat < 1.0 else 'MISSED'}")
    if errors:
        print(f"WARNING: {errors} errors (non-2xx or socket errors) during the runs; see the table")
    print()
    print("CPU during each run, % of one core (from /proc; other_load = machine busy - these processes):")
    print(fmt_cpu(results))
    print(f"\ntotal time {time.time() - started:.0f}s")

    if args.json is not None:
        doc = {
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "envoy_concurrency": args.envoy_concurrency,
            "duration_s": args.duration,
            "connections": args.connections,
            "repeat": args.repeat,
            "same_sim": args.same_sim,
            "code": code,
            "load_before": load_before,
            "load_after": load_after,
            "rows": rows,
            "peak_rps": peak,
            "peak_connections": peak_conns,
            "ratios": ratios,
            "ratios_at_fixed_connections": {str(c): v for c, v in fixed.items()},
            "added_p50_ms": added,
            "targets": {
                "throughput_ratio_min": t_rps,
                "throughput_met": t_rps >= 0.4,
                "native_throughput_ratio_min": t_native,
                "native_throughput_met": t_native >= 0.8,
                "added_p50_ms_max_vs_direct": t_lat,
                "latency_met": t_lat < 1.0,
            },
            "errors": errors,
            "runs": [
                {**asdict(r), "errors": r.errors, "cpu_us_per_req": round(r.cpu_us_per_request, 1)} for r in results
            ],
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
