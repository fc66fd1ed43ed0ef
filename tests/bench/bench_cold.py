"""Cold-start benchmark (issue: scale to zero): readiness -> held request, and 10,000 held requests.

Run from the repository root (not collected by `pytest tests`):

    python -m tests.bench.bench_cold [--starts 50] [--models 10] [--startup-seconds 0.3]
                                     [--held 10000] [--held-h2 C] [--held-startup-seconds 30]
                                     [--skip-latency] [--skip-held] [--json OUT] [--keep-tmp]

Part (a), readiness -> held request reaches the backend. One `wakegate up` (via
tests/gateway/support.py's UpProcess) serves `--models` sim models `cold-0..`, each
`scaling: {min: 0, max: 1, idleTimeout: 1}` with sim args `--startup-seconds S --log-requests`
(the sim then logs `sim timing ready t=` and `sim timing request t=` in epoch seconds with
microseconds). The models are used round-robin: before each of `--starts` cold starts the
benchmark waits until `/status` shows the model with no replica and the previous backend pid is
gone, then sends one chat completion (model in the JSON body) and reads, from the logs:

* t_ready   sim log, `sim timing ready` (µs)
* t_probe   up log, `replica ready model=...` (the runtime's 20 ms probe saw 200; ms resolution)
* t_release extproc log, `model ready model=... held=1` (the route with the endpoint reached
  extproc, after Envoy acked the EDS update; ms resolution)
* t_arrival sim log, `sim timing request` (µs)

and reports t_arrival - t_ready (p50/p99/max), with the breakdown detect = t_probe - t_ready,
push = t_release - t_probe (feeder snapshot + Envoy ack + ModelRoute push to extproc),
forward = t_arrival - t_release (extproc resumes the ext_proc stream, Envoy connects upstream).

Part (b), `--held` held cold requests on one gateway. A second `wakegate up` serves one model
`held` (`maxQueue` = `--held`, `activationTimeout` 600 s, sim `--startup-seconds
--held-startup-seconds`). The benchmark raises RLIMIT_NOFILE (children inherit it), samples
VmRSS of extproc and Envoy (children of `up`, told apart by their command lines) before load,
opens `--held` concurrent requests (aiohttp, `TCPConnector(limit=0)`: one HTTP/1.1 connection
each; with `--held-h2 C`, over C HTTP/2 connections, `tests/support/h2requests.py`), waits for `/status`
queued to reach them, samples RSS while they are held, then waits for activation and checks
every answer, and samples RSS again after the client closed its connections. Envoy's
allocator total (`/memory`) is sampled with RSS: per held request, it is Envoy's cost without
the allocator's page noise. Flush times are
from the sim's `sim ready` line to the first and last response.

Every process it started is stopped on exit, Ctrl-C or error.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime as dt
import itertools
import json
import os
import re
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from tests.bench.common import git_state, loadavg
from tests.bench.gateway_probes import envoy_allocated_mib, envoy_stats, gateway_pids
from tests.bench.procs import cpu_seconds, open_fds, proc_mem
from tests.support.h2requests import Connection
from tests.support.http import request
from tests.support.up import UpProcess, model_doc, pids_alive
from wakegate.control.admin import free_port

BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

# -- helpers ------------------------------------------------------------------------------------


def log_time(line: str) -> float:
    """Epoch seconds of a `%(asctime)s` log line (`2026-11-30 12:30:39,349 ...`, local time, ms)."""
    stamp = dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()


class LogTail:
    """Lines appended to a file since the last mark."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def mark(self) -> None:
        self.offset = self.path.stat().st_size if self.path.exists() else 0

    def new_lines(self) -> list[str]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            return f.read().decode(errors="replace").splitlines()


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "min": min(values),
        "p50": pct(values, 50),
        "p90": pct(values, 90),
        "p99": pct(values, 99),
        "max": max(values),
        "mean": statistics.fmean(values),
    }


def model_yaml(name: str, args: list[str], scaling: str, endpoint: str = "") -> str:
    return model_doc(name, extra=f"  args: {json.dumps(args)}\n  scaling: {scaling}\n{endpoint}")


def model_status(up: UpProcess, key: str) -> dict[str, Any]:
    for model in up.status()["models"]:
        if model["key"] == key:
            return model  # type: ignore[no-any-return]
    raise KeyError(key)


def _up_args(args: argparse.Namespace) -> list[str]:
    """Envoy's admin API on a loopback port, for `envoy_stats` (up's default is a Unix socket)."""
    return ["--envoy-concurrency", str(args.envoy_concurrency), "--envoy-admin-listen", f"127.0.0.1:{free_port()}"]


# -- part (a): readiness -> held request --------------------------------------------------------


READY_RE = re.compile(r"sim timing ready t=([0-9.]+)")
ARRIVAL_RE = re.compile(r"sim timing request t=([0-9.]+)")


def run_latency(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    names = [f"cold-{i}" for i in range(args.models)]
    sim_args = ["--startup-seconds", str(args.startup_seconds), "--log-requests"]
    scaling = "{min: 0, max: 1, idleTimeout: 1, activationTimeout: 60}"
    yaml_text = "".join(model_yaml(n, sim_args, scaling) for n in names)
    (tmp / "a").mkdir()
    up = UpProcess(tmp / "a", yaml_text, *_up_args(args))
    samples: list[dict[str, Any]] = []
    try:
        up.wait_ready({n: 0 for n in names}, timeout=90)
        state_logs = up.state_dir / "logs"
        up_tail = LogTail(up.log_path)
        ext_tail = LogTail(state_logs / "extproc-0.log")
        last_pid: dict[str, int] = {}
        started = time.monotonic()
        for i in range(args.starts):
            name = names[i % len(names)]
            # at zero: no replica in /status and the previous backend process gone
            deadline = time.monotonic() + 60
            while True:
                m = model_status(up, name)
                prev = last_pid.get(name)
                if not m["replicas"] and m["ready"] == 0 and (prev is None or not pids_alive([prev])):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not scale to zero in 60 s: {m}")
                time.sleep(0.05)
            others = sum(len(mm["replicas"]) for mm in up.status()["models"] if mm["key"] != name)
            for t in (up_tail, ext_tail):
                t.mark()
            # each replica start gets a new log file (<model>-<index>.log); remember where old ones end
            sim_marks = {p: p.stat().st_size for p in state_logs.glob(f"{name}-*.log")}
            load1 = os.getloadavg()[0]
            t_send = time.time()
            resp = request("POST", f"{up.base_url}/chat/completions", body={"model": name, **BODY}, timeout=60)
            t_recv = time.time()
            if resp.status != 200:
                raise RuntimeError(f"cold request {i} to {name}: {resp.status} {resp.text[:300]}")
            # the logs are written before the response leaves; give the files a moment anyway
            m = model_status(up, name)
            if not m["replicas"]:
                raise RuntimeError(f"cold request {i} to {name} answered but /status shows no replica: {m}")
            replica = m["replicas"][0]
            last_pid[name] = replica["pid"]
            sim_log = Path(replica["log"])
            sim_log = sim_log if sim_log.is_absolute() else up.tmp / sim_log
            sim_tail = LogTail(sim_log)
            sim_tail.offset = sim_marks.get(sim_log, 0)
            for _ in range(50):
                sim_lines = sim_tail.new_lines()
                up_lines = up_tail.new_lines()
                ext_lines = ext_tail.new_lines()
                ready = [float(mt.group(1)) for ln in sim_lines if (mt := READY_RE.search(ln))]
                arrival = [float(mt.group(1)) for ln in sim_lines if (mt := ARRIVAL_RE.search(ln))]
                probe = [log_time(ln) for ln in up_lines if f"replica ready model={name} " in ln]
                release = [log_time(ln) for ln in ext_lines if f"model ready model={name} " in ln]
                if ready and arrival and probe and release:
                    break
                time.sleep(0.02)
            else:
                raise RuntimeError(f"cold start {i} ({name}): missing log lines\n{up.log()[-3000:]}")
            t_ready, t_arrival, t_probe, t_release = ready[0], arrival[0], probe[0], release[0]
            sample = {
                "i": i,
                "model": name,
                "ready_to_arrival_ms": (t_arrival - t_ready) * 1000,
                "detect_ms": (t_probe - t_ready) * 1000,
                "push_ms": (t_release - t_probe) * 1000,
                "forward_ms": (t_arrival - t_release) * 1000,
                "client_total_ms": (t_recv - t_send) * 1000,
                "send_to_ready_ms": (t_ready - t_send) * 1000,
                "other_replicas_at_send": others,
                "load1": round(load1, 2),
            }
            samples.append(sample)
            if args.verbose:
                print(
                    f"  {i:3d} {name:8s} ready->arrival {sample['ready_to_arrival_ms']:7.2f} ms "
                    f"(detect {sample['detect_ms']:6.1f} push {sample['push_ms']:6.1f} "
                    f"forward {sample['forward_ms']:6.1f}) client {sample['client_total_ms']:7.1f} ms",
                    flush=True,
                )
        elapsed = time.monotonic() - started
    finally:
        rc = up.stop()
    out: dict[str, Any] = {
        "models": args.models,
        "startup_seconds": args.startup_seconds,
        "elapsed_s": round(elapsed, 1),
        "up_exit": rc,
        "samples": samples,
    }
    for key in ("ready_to_arrival_ms", "detect_ms", "push_ms", "forward_ms", "client_total_ms"):
        out[key] = summary([s[key] for s in samples])
    out["target_p99_ms"] = args.target_p99_ms
    out["target_met"] = out["ready_to_arrival_ms"]["p99"] < args.target_p99_ms
    return out


# -- part (b): many held requests ---------------------------------------------------------------


def raise_nofile(want: int) -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    note = ""
    if hard < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
            soft, hard = want, want
        except (ValueError, OSError) as exc:
            note = f"could not raise the hard limit {hard} to {want}: {exc}"
    if soft < min(want, hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return {"soft": soft, "hard": hard, "note": note}


async def run_held_async(args: argparse.Namespace, up: UpProcess, pids: dict[str, int]) -> dict[str, Any]:
    import aiohttp

    n = args.held
    status_url = f"http://127.0.0.1:{up.admin_port}/status"
    url = f"{up.base_url}/chat/completions"
    body = json.dumps({"model": "held", **BODY}).encode()
    results: list[tuple[int, float, str]] = []  # (status, t_done, error)
    bodies: dict[int, str] = {}  # one example body per non-200 status
    mem: dict[str, Any] = {}
    fds: dict[str, Any] = {}

    cpu: dict[str, Any] = {}
    timeline: list[tuple[float, int, int, int]] = []  # (t - t0, queued, in_flight, ready)

    def sample(label: str) -> None:
        mem[label] = {name: proc_mem(pid) for name, pid in pids.items()}
        mem[label]["bench-client"] = proc_mem(os.getpid())
        mem[label]["envoy-allocated"] = envoy_allocated_mib(up)
        fds[label] = {name: open_fds(pid) for name, pid in pids.items()}
        cpu[label] = {name: cpu_seconds(pid) for name, pid in pids.items()}
        cpu[label]["bench-client"] = cpu_seconds(os.getpid())
        cpu[label]["t"] = time.time()

    async def status(session: aiohttp.ClientSession) -> dict[str, Any]:
        async with session.get(status_url) as r:
            for m in (await r.json())["models"]:
                if m["key"] == "held":
                    return m  # type: ignore[no-any-return]
        raise KeyError("held")

    sample("before")
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=args.client_timeout, connect=None, sock_connect=None, sock_read=None)
    client = aiohttp.ClientSession(connector=connector, timeout=timeout)
    admin = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))

    async def one() -> None:
        try:
            async with client.post(url, data=body, headers={"content-type": "application/json"}) as r:
                text = (await r.read()).decode(errors="replace")
                results.append((r.status, time.time(), ""))
        except Exception as exc:  # every failure is counted by kind
            results.append((0, time.time(), f"{type(exc).__name__}: {exc}"[:200]))
            return
        if r.status != 200 and r.status not in bodies:
            bodies[r.status] = text[:300]

    h2: list[Connection] = []

    async def one_h2(index: int) -> None:
        # --held-h2 C: the requests share C HTTP/2 connections, round robin
        conn = h2[index % len(h2)]
        try:
            answer = await asyncio.wait_for(
                conn.request("POST", "/v1/chat/completions", "gateway", {"content-type": "application/json"}, body),
                args.client_timeout,
            )
        except TimeoutError:
            results.append((0, time.time(), "TimeoutError"))
            return
        results.append((answer.status, time.time(), answer.error))
        if answer.status not in (0, 200) and answer.status not in bodies:
            bodies[answer.status] = answer.body.decode(errors="replace")[:300]

    t0 = time.time()
    tasks: list[asyncio.Task[None]] = []
    max_queued = 0
    queued_at: float | None = None
    t_ready_seen: float | None = None
    open_s: float | None = None
    try:
        if args.held_h2:
            port = int(urllib.parse.urlsplit(url).port or 80)
            h2.extend([await Connection.open("127.0.0.1", port) for _ in range(args.held_h2)])
        for start in range(0, n, args.batch):
            for i in range(start, start + min(args.batch, n - start)):
                tasks.append(asyncio.create_task(one_h2(i) if h2 else one()))
            await asyncio.sleep(args.batch_gap)
        # wait until all are held (or the model got ready first, or requests failed)
        deadline = time.monotonic() + args.held_startup_seconds + 120
        while time.monotonic() < deadline:
            m = await status(admin)
            max_queued = max(max_queued, m["queued"])
            timeline.append((round(time.time() - t0, 2), m["queued"], m["in_flight"], m["ready"]))
            if m["ready"] > 0:
                t_ready_seen = time.time()
                break
            if m["queued"] >= n:
                queued_at = time.time()
                break
            if m["queued"] + len(results) >= n and m["queued"] == max_queued and len(timeline) > 3:
                # some failed while the rest are held: this is as many as will be held at once
                queued_at = time.time()
                break
            if len(results) >= n:
                break
            await asyncio.sleep(0.2)
        open_s = (queued_at or time.time()) - t0
        print(
            f"  held: queued={max_queued}/{n} after {open_s:.1f}s (failed so far: {len(results)}), load {loadavg()}",
            flush=True,
        )
        await asyncio.sleep(1.0)
        sample("held")
        m = await status(admin)
        held_status = {k: m[k] for k in ("queued", "in_flight", "leases", "ready", "state")}
        stats_held = await asyncio.to_thread(envoy_stats, up)
        # activation: wait for every request to finish
        done_deadline = time.monotonic() + args.held_startup_seconds + args.client_timeout
        while len(results) < n and time.monotonic() < done_deadline:
            with contextlib.suppress(Exception):
                m = await status(admin)
                timeline.append((round(time.time() - t0, 2), m["queued"], m["in_flight"], m["ready"]))
                if t_ready_seen is None and m["ready"] > 0:
                    t_ready_seen = time.time()
            await asyncio.sleep(0.2)
        await asyncio.gather(*tasks, return_exceptions=True)
        t_all_done = time.time()
        sample("answered")
    finally:
        for t in tasks:
            t.cancel()
        await client.close()
        await admin.close()
        for conn in h2:
            await conn.close()
    await asyncio.sleep(3.0)
    sample("after")
    return {
        "t0": t0,
        "results": results,
        "mem": mem,
        "fds": fds,
        "max_queued": max_queued,
        "queued_all_at": queued_at,
        "open_s": open_s,
        "held_status": held_status,
        "t_all_done": t_all_done,
        "cpu": cpu,
        "timeline": timeline,
        "bodies": bodies,
        "envoy_stats_held": stats_held,
        "envoy_stats_after": await asyncio.to_thread(envoy_stats, up),
    }


def run_held(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    n = args.held
    limits = raise_nofile(args.nofile)
    print(f"  RLIMIT_NOFILE soft={limits['soft']} hard={limits['hard']} {limits['note']}", flush=True)
    sim_args = ["--startup-seconds", str(args.held_startup_seconds)]
    scaling = "{min: 0, max: 1, idleTimeout: 300, activationTimeout: 600}"
    endpoint = f"  endpoint: {{maxQueue: {min(max(n, 1), 100000)}, coldMode: hold}}\n"
    (tmp / "b").mkdir()
    up = UpProcess(tmp / "b", model_yaml("held", sim_args, scaling, endpoint), *_up_args(args))
    try:
        up.wait_ready({"held": 0}, timeout=90)
        pids = gateway_pids(up)
        if set(pids) != {"envoy", "extproc"}:
            raise RuntimeError(f"could not find envoy and extproc among children of up: {pids}")
        load_before = loadavg()
        raw = asyncio.run(run_held_async(args, up, pids))
        load_after = loadavg()
        sim_log = up.state_dir / "logs" / "held-0.log"
        t_sim_ready = None
        with contextlib.suppress(OSError):
            for line in sim_log.read_text(errors="replace").splitlines():
                if "sim ready model=held" in line:
                    t_sim_ready = log_time(line)
                    break
        ext_release = None
        with contextlib.suppress(OSError):
            for line in (up.state_dir / "logs" / "extproc-0.log").read_text(errors="replace").splitlines():
                if "model ready model=held" in line:
                    ext_release = log_time(line)
                    break
        sim_rss = {}
        m = model_status(up, "held")
        if m["replicas"]:
            sim_rss = proc_mem(m["replicas"][0]["pid"])
        envoy_log_tail = (up.state_dir / "logs" / "envoy.log").read_text(errors="replace")[-2000:]
        extproc_warnings = [
            ln
            for ln in (up.state_dir / "logs" / "extproc-0.log").read_text(errors="replace").splitlines()
            if " WARNING " in ln or " ERROR " in ln
        ][-20:]
    finally:
        rc = up.stop(timeout=60)
    results = raw["results"]
    codes = collections.Counter(status for status, _, _ in results)
    errors = collections.Counter(err.split(":")[0] for status, _, err in results if err)
    error_examples = list({err for _, _, err in results if err})[:5]
    ok_times = sorted(t for status, t, _ in results if status == 200)
    flush: dict[str, Any] = {}
    if t_sim_ready is not None and ok_times:
        flush = {
            "first_response_after_ready_s": ok_times[0] - t_sim_ready,
            "last_response_after_ready_s": ok_times[-1] - t_sim_ready,
            "p50_response_after_ready_s": pct([t - t_sim_ready for t in ok_times], 50),
            "extproc_release_after_ready_s": (ext_release - t_sim_ready) if ext_release else None,
        }
    return {
        "held": n,
        "client": f"HTTP/2, {args.held_h2} connections" if args.held_h2 else "HTTP/1.1, one connection each",
        "startup_seconds": args.held_startup_seconds,
        "envoy_concurrency": args.envoy_concurrency,
        "rlimit_nofile": limits,
        "max_queued_seen": raw["max_queued"],
        "all_queued": raw["max_queued"] >= n,
        "open_s": raw["open_s"],
        "status_while_held": raw["held_status"],
        "codes": {str(k): v for k, v in codes.items()},
        "errors": dict(errors),
        "error_examples": error_examples,
        "all_200": codes.get(200, 0) == n,
        "flush": flush,
        "mem_mib": raw["mem"],
        "fds": raw["fds"],
        "sim_mem_mib": sim_rss,
        "cpu_s": cpu_deltas(raw["cpu"]),
        "queued_timeline": raw["timeline"],
        "time_to_queued": time_to_fraction(raw["timeline"], n),
        "example_bodies": {str(k): v for k, v in raw["bodies"].items()},
        "envoy_stats_held": raw["envoy_stats_held"],
        "envoy_stats_after": raw["envoy_stats_after"],
        "load_before": load_before,
        "load_after": load_after,
        "up_exit": rc,
        "extproc_warnings": extproc_warnings,
        "envoy_log_tail": envoy_log_tail if any(c != 200 for c in codes) else "",
    }


def cpu_deltas(cpu: dict[str, dict[str, float | None]]) -> dict[str, dict[str, float]]:
    """CPU seconds each process used between consecutive samples (before -> held -> answered -> after)."""
    labels = [lb for lb in ("before", "held", "answered", "after") if lb in cpu]
    out: dict[str, dict[str, float]] = {}
    for a, b in itertools.pairwise(labels):
        phase: dict[str, float] = {"wall": round(float(cpu[b]["t"] or 0) - float(cpu[a]["t"] or 0), 2)}
        for who in cpu[a]:
            if who != "t" and cpu[a][who] is not None and cpu[b].get(who) is not None:
                phase[who] = round(float(cpu[b][who] or 0) - float(cpu[a][who] or 0), 2)
        out[f"{a}->{b}"] = phase
    return out


def time_to_fraction(timeline: list[tuple[float, int, int, int]], n: int) -> dict[str, float | None]:
    """Seconds from the first request until /status showed 25/50/90/100 % of them queued."""
    out: dict[str, float | None] = {}
    for frac in (0.25, 0.5, 0.9, 1.0):
        hit = next((t for t, queued, _, _ in timeline if queued >= frac * n), None)
        out[f"{int(frac * 100)}%"] = hit
    return out


# -- main ---------------------------------------------------------------------------------------


def fmt_latency(res: dict[str, Any]) -> str:
    lines = [
        f"(a) readiness -> held request at the backend: {res['ready_to_arrival_ms']['n']} cold starts "
        f"over {res['models']} models, sim startup {res['startup_seconds']} s, {res['elapsed_s']} s",
        f"    {'ms':22s} {'p50':>8s} {'p90':>8s} {'p99':>8s} {'max':>8s} {'mean':>8s}",
    ]
    for key, label in (
        ("ready_to_arrival_ms", "ready -> arrival"),
        ("detect_ms", "  detect (probe)"),
        ("push_ms", "  push (xDS+ack)"),
        ("forward_ms", "  forward (Envoy)"),
        ("client_total_ms", "client request total"),
    ):
        s = res[key]
        lines.append(
            f"    {label:22s} {s['p50']:8.2f} {s['p90']:8.2f} {s['p99']:8.2f} {s['max']:8.2f} {s['mean']:8.2f}"
        )
    p99 = res["ready_to_arrival_ms"]["p99"]
    verdict = "met" if res["target_met"] else f"MISSED by {p99 - res['target_p99_ms']:.1f} ms"
    lines.append(f"    target p99 < {res['target_p99_ms']:.0f} ms: {verdict} (p99 {p99:.2f} ms)")
    return "\n".join(lines)


def fmt_held(res: dict[str, Any]) -> str:
    mem = res["mem_mib"]
    lines = [
        f"(b) {res['held']} held cold requests (sim startup {res['startup_seconds']} s, "
        f"RLIMIT_NOFILE {res['rlimit_nofile']['soft']}):",
        f"    queued max {res['max_queued_seen']} (all held at once: {res['all_queued']}), "
        f"open took {res['open_s']:.1f} s; /status while held: {res['status_while_held']}",
        f"    answers: {res['codes']}  errors: {res['errors'] or 'none'}  all 200: {res['all_200']}",
    ]
    if res["error_examples"]:
        lines.append(f"    error examples: {res['error_examples']}")
    if res["flush"]:
        f = res["flush"]
        rel = f["extproc_release_after_ready_s"]
        lines.append(
            f"    after sim ready: extproc release {rel if rel is None else round(rel, 3)} s, first response "
            f"{f['first_response_after_ready_s']:.3f} s, p50 {f['p50_response_after_ready_s']:.3f} s, "
            f"last {f['last_response_after_ready_s']:.3f} s"
        )
    lines.append(f"    {'MiB VmRSS':12s} {'before':>8s} {'held':>8s} {'answered':>9s} {'after':>8s} {'peak':>8s}")
    for who in ("extproc", "envoy", "bench-client"):
        row = [
            mem.get(label, {}).get(who, {}).get("VmRSS", float("nan"))
            for label in ("before", "held", "answered", "after")
        ]
        peak = mem.get("after", {}).get(who, {}).get("VmHWM", float("nan"))
        lines.append(f"    {who:12s} {row[0]:8.1f} {row[1]:8.1f} {row[2]:9.1f} {row[3]:8.1f} {peak:8.1f}")
    lines.append(f"    client: {res['client']}")
    held_n = max(res["max_queued_seen"], 1)
    per = {
        who: (mem.get("held", {}).get(who, {}).get("VmRSS", float("nan"))
              - mem.get("before", {}).get(who, {}).get("VmRSS", float("nan"))) * 1024 / held_n
        for who in ("extproc", "envoy")
    }
    alloc = mem.get("held", {}).get("envoy-allocated"), mem.get("before", {}).get("envoy-allocated")
    envoy_alloc = (alloc[0] - alloc[1]) * 1024 / held_n if None not in alloc else float("nan")
    lines.append(
        f"    per held request (KB): Envoy RSS {per['envoy']:.1f}, Envoy allocated {envoy_alloc:.1f}, "
        f"extproc RSS {per['extproc']:.1f}; gateway (Envoy allocated + extproc) {envoy_alloc + per['extproc']:.1f}"
    )
    lines.append(f"    open fds: {res['fds']}")
    lines.append(f"    time to queued (s after first request): {res['time_to_queued']}")
    lines.append(f"    CPU seconds by phase: {res['cpu_s']}")
    if res["example_bodies"]:
        lines.append(f"    example non-200 bodies: {res['example_bodies']}")
    if res["envoy_stats_after"]:
        lines.append(f"    Envoy counters (non-zero, after): {res['envoy_stats_after']}")
    if res["sim_mem_mib"]:
        lines.append(f"    sim backend: {res['sim_mem_mib']}")
    lines.append(f"    load average {res['load_before']} -> {res['load_after']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.bench_cold", description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--starts", type=int, default=50, help="cold starts measured in part (a) (default 50)")
    ap.add_argument("--models", type=int, default=10, help="models used round-robin in part (a) (default 10)")
    ap.add_argument("--startup-seconds", type=float, default=0.3, help="sim load time in part (a)")
    ap.add_argument("--target-p99-ms", type=float, default=50.0, help="the issue's target for part (a)")
    ap.add_argument("--held", type=int, default=10000, help="concurrent held requests in part (b)")
    ap.add_argument("--held-startup-seconds", type=float, default=30.0, help="sim load time in part (b)")
    ap.add_argument("--batch", type=int, default=500, help="part (b): requests started per batch")
    ap.add_argument("--batch-gap", type=float, default=0.05, help="part (b): seconds between batches")
    ap.add_argument(
        "--held-h2", type=int, default=0, metavar="C",
        help="part (b): send the held requests over C HTTP/2 connections (prior knowledge) instead of one "
        "HTTP/1.1 connection each",
    )
    ap.add_argument("--client-timeout", type=float, default=300.0, help="part (b): per-request timeout")
    ap.add_argument("--nofile", type=int, default=65536, help="RLIMIT_NOFILE to set (children inherit it)")
    ap.add_argument("--envoy-concurrency", type=int, default=2, help="Envoy worker threads (up's default: 2)")
    ap.add_argument("--skip-latency", action="store_true", help="skip part (a)")
    ap.add_argument("--skip-held", action="store_true", help="skip part (b)")
    ap.add_argument("--verbose", "-v", action="store_true", help="print every cold start of part (a)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here as JSON")
    ap.add_argument("--keep-tmp", action="store_true", help="keep the temp dir (logs, configs)")
    args = ap.parse_args(argv)

    def on_term(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    tmp = Path(tempfile.mkdtemp(prefix="wakegate-bench-cold-"))
    out: dict[str, Any] = {
        "code": git_state(),
        "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "load_before": loadavg(),
    }
    failed = True
    try:
        print(f"load average before: {out['load_before']}  (cpus: {out['cpus']})  tmp: {tmp}", flush=True)
        if not args.skip_latency:
            out["latency"] = run_latency(args, tmp)
            print(fmt_latency(out["latency"]), flush=True)
            print(f"    load average now: {loadavg()}", flush=True)
        if not args.skip_held:
            out["held"] = run_held(args, tmp)
            print(fmt_held(out["held"]), flush=True)
        failed = False
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, AssertionError, urllib.error.URLError) as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        out["error"] = str(exc)
        return 1
    finally:
        out["load_after"] = loadavg()
        print(f"load average after: {out['load_after']}", flush=True)
        code = out["code"]
        print(f"code: git HEAD {code['head']}, uncommitted gateway changes: {code['worktree_changes']}")
        if args.json is not None:
            args.json.write_text(json.dumps(out, indent=2, default=str))
        if args.keep_tmp or failed:
            print(f"logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
