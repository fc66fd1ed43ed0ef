"""Soak benchmark: one real `wakegate up` under steady mixed traffic for an hour (docs/reliability.md, "Soak").

Run from the repository root (not collected by `pytest tests`):

    python -m tests.bench.bench_soak [--seconds 3600] [--rps 3] [--sample-every 10] [--json OUT]

One `wakegate up` (real Envoy, both extprocs, the feeder, sim backends) with an API key file and
three models:

* `warm`: one replica, always up; chat requests, plain and streamed;
* `cold`: scale to zero, `idleTimeout` 15 s, 2 s to start; a pair of requests (one streamed)
  every `--cold-every` seconds, so it idles out and wakes again and again;
* `lora`: one replica that holds one adapter at a time, three adapters asked for in turn, so
  adapters are swapped in and out all the time.

Next to them, bad input (a body that is not JSON, a model nobody serves, no messages, a key
that was retired): each must get its 4xx. Every `--rotate-every` seconds the key is rotated: a
new key is added to the file, clients move to it, the old one is removed, and is then asked
with to check it is refused.

Every `--sample-every` seconds it records the RSS and the open file descriptors of every
process: `up`, the feeder, both extprocs, Envoy and each backend replica. Errors are: a request
that did not get what it should (a 200 with `[DONE]` for streams; the expected 4xx for bad
input; any 5xx, 429 or failed connection), an ERROR line or traceback in the logs of `up`, the
feeder and the extprocs, and a component restart. RSS growth per process compares the mean over
a window after warm-up (by default minutes 5 to 10 of an hour: `--seconds` / 12 to / 6) with the
mean over the last `--seconds` / 12, so that what a process allocates as it starts is not
counted; a `cold` replica is a new process at every wake, so its line is per wake instead.

Target (docs/reliability.md): < 5 % RSS growth per process over the hour, 0 errors.
"""

from __future__ import annotations

import argparse
import http.client
import json
import secrets
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tests.bench.common import git_state, loadavg
from tests.support.faults import log_errors
from tests.support.up import UpProcess, adapter_doc, model_doc

ADAPTERS = ("a0", "a1", "a2")
COLD_IDLE_SECONDS = 15


def models_yaml() -> str:
    docs = [
        model_doc("warm", extra='  scaling: {min: 1, max: 1}\n  args: ["--tokens-per-second", "100"]\n'),
        model_doc(
            "cold",
            extra=f"  scaling: {{min: 0, max: 1, idleTimeout: {COLD_IDLE_SECONDS}}}\n"
            '  args: ["--startup-seconds", "2", "--tokens-per-second", "100"]\n',
        ),
        model_doc(
            "lora",
            extra='  scaling: {min: 1, max: 1}\n  adapters: {maxAdapters: 1}\n  args: ["--tokens-per-second", "100"]\n',
        ),
    ]
    docs += [adapter_doc(name, "lora", f"file://adapters/{name}", f"lora-{name}") for name in ADAPTERS]
    return "".join(docs)


@dataclass
class Outcome:
    kind: str
    ok: bool
    what: str
    seconds: float


@dataclass
class Tally:
    sent: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    #: The first few failures, as "kind: what".
    examples: list[str] = field(default_factory=list)
    slowest: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: Outcome) -> None:
        with self.lock:
            self.sent[outcome.kind] += 1
            self.slowest[outcome.kind] = max(self.slowest.get(outcome.kind, 0.0), round(outcome.seconds, 3))
            if not outcome.ok:
                self.failed[outcome.kind] += 1
                if len(self.examples) < 20:
                    self.examples.append(f"{time.strftime('%H:%M:%S')} {outcome.kind}: {outcome.what}")


class Keys:
    """The key file and its rotation: clients use `current`; `retired` was removed from the file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.current = secrets.token_urlsafe(24)
        self.retired: str | None = None
        self.rotations = 0
        self._write([self.current])

    def _write(self, keys: list[str]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(f"{k}\n" for k in keys))
        tmp.replace(self.path)

    def rotate(self, stop: threading.Event, grace: float) -> None:
        """Add a new key, move clients to it after `grace`, remove the old one after another `grace`."""
        old, new = self.current, secrets.token_urlsafe(24)
        self._write([old, new])
        if stop.wait(grace):
            return
        self.current = new
        if stop.wait(grace):
            return
        self._write([new])
        if stop.wait(grace):
            return
        self.retired = old
        self.rotations += 1


def request(port: int, path: str, body: bytes, key: str | None, *, timeout: float = 60) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    try:
        conn.request("POST", path, body, headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def chat(model: str, max_tokens: int, *, stream: bool = False) -> bytes:
    body = {"model": model, "messages": [{"role": "user", "content": "soak"}], "max_tokens": max_tokens}
    return json.dumps({**body, "stream": stream}).encode()


class Load:
    """Steady traffic at `rps` requests/s, a cold pair every `cold_every` s, on a thread pool."""

    #: The mix of the steady traffic, in turn: (kind, path, body, expected status or None for any 4xx).
    MIX: tuple[tuple[str, str, bytes, int | None], ...] = (
        ("warm", "/v1/chat/completions", chat("warm", 8), 200),
        ("warm-stream", "/v1/chat/completions", chat("warm", 24, stream=True), 200),
        ("adapter", "/v1/completions", b"", 200),  # the body names the next adapter
        ("warm", "/v1/chat/completions", chat("warm", 8), 200),
        ("bad-json", "/v1/chat/completions", b"{not json", None),
        ("warm-stream", "/v1/chat/completions", chat("warm", 24, stream=True), 200),
        ("unknown-model", "/v1/chat/completions", chat("nobody-serves-this", 4), None),
        ("adapter", "/v1/completions", b"", 200),
        ("no-messages", "/v1/chat/completions", json.dumps({"model": "warm"}).encode(), None),
        ("retired-key", "/v1/chat/completions", chat("warm", 4), 401),
    )

    def __init__(self, up: UpProcess, keys: Keys, tally: Tally, *, rps: float, cold_every: float) -> None:
        self.up, self.keys, self.tally = up, keys, tally
        self.rps, self.cold_every = rps, cold_every
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(max_workers=16)
        self._adapter = 0

    def one(self, kind: str, path: str, body: bytes, expect: int | None) -> None:
        key: str | None = self.keys.current
        if kind == "retired-key":
            if self.keys.retired is None:
                return
            key = self.keys.retired
        if kind == "adapter":
            self._adapter += 1
            name = f"lora-{ADAPTERS[self._adapter % len(ADAPTERS)]}"
            body = json.dumps({"model": name, "prompt": "soak", "max_tokens": 4}).encode()
        stream = b'"stream": true' in body
        started = time.monotonic()
        try:
            status, data = request(self.up.port, path, body, key)
        except (OSError, http.client.HTTPException) as exc:
            self.tally.add(Outcome(kind, False, type(exc).__name__, time.monotonic() - started))
            return
        if expect is None:
            ok = 400 <= status < 500 and status != 429 and data.startswith(b"{") and b'"error"' in data
        else:
            ok = status == expect
        if ok and stream:
            ok = data.rstrip().endswith(b"data: [DONE]")
        self.tally.add(Outcome(kind, ok, f"{status} {data[:160]!r}", time.monotonic() - started))

    def run(self) -> None:
        period = 1.0 / self.rps
        next_at = time.monotonic()
        next_cold = next_at + 5.0
        i = 0
        while not self.stop.is_set():
            kind, path, body, expect = self.MIX[i % len(self.MIX)]
            i += 1
            self.pool.submit(self.one, kind, path, body, expect)
            now = time.monotonic()
            if now >= next_cold:
                self.pool.submit(self.one, "cold", "/v1/chat/completions", chat("cold", 8), 200)
                self.pool.submit(self.one, "cold-stream", "/v1/chat/completions", chat("cold", 24, stream=True), 200)
                next_cold = now + self.cold_every
            next_at += period
            self.stop.wait(max(0.0, next_at - time.monotonic()))
        self.pool.shutdown(wait=True)


def processes(up: UpProcess) -> dict[str, int]:
    """Name -> pid of every process of the gateway: `up`, its components, each backend replica."""
    status = up.status()
    found = {"up": up.proc.pid}
    found.update({name: c["pid"] for name, c in status["components"].items() if c["pid"]})
    for model in status["models"]:
        for replica in model["replicas"]:
            if replica["pid"]:
                found[f"{model['key']}-{replica['index']}"] = replica["pid"]
    return found


def rss_and_fds(pid: int) -> tuple[int, int] | None:
    """(RSS in KiB, open file descriptors) of `pid`; None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
                break
        else:
            return None
        return rss, len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except (OSError, ValueError):
        return None


@dataclass
class Sample:
    t: float
    load: float
    #: name -> (pid, RSS KiB, fds)
    procs: dict[str, tuple[int, int, int]]


def sample(up: UpProcess, t: float) -> Sample:
    procs = {}
    for name, pid in processes(up).items():
        got = rss_and_fds(pid)
        if got is not None:
            procs[name] = (pid, *got)
    return Sample(round(t, 1), loadavg()[0], procs)


def growth(samples: list[Sample], seconds: float) -> list[dict[str, object]]:
    """Per process (and pid): mean RSS over the window after warm-up against the last window."""
    base_from, base_to, last_from = seconds / 12, seconds / 6, seconds - seconds / 12
    rows = []
    keys = sorted({(name, s.procs[name][0]) for s in samples for name in s.procs})
    for name, pid in keys:
        mine = [(s.t, s.procs[name][1], s.procs[name][2]) for s in samples if s.procs.get(name, (0,))[0] == pid]
        base = [rss for t, rss, _ in mine if base_from <= t <= base_to]
        last = [rss for t, rss, _ in mine if t >= last_from]
        row: dict[str, object] = {
            "process": name,
            "pid": pid,
            "first_kib": mine[0][1],
            "max_kib": max(rss for _, rss, _ in mine),
            "fds_first": mine[0][2],
            "fds_last": mine[-1][2],
            "fds_max": max(fds for _, _, fds in mine),
            "lived_s": round(mine[-1][0] - mine[0][0], 1),
        }
        if base and last:
            b, a = statistics.mean(base), statistics.mean(last)
            row.update(base_kib=round(b), last_kib=round(a), growth_pct=round(100 * (a - b) / b, 2))
        rows.append(row)
    return rows


def restarts(up: UpProcess) -> dict[str, int]:
    status = up.status()
    out = {name: c["restarts"] for name, c in status["components"].items() if c["restarts"]}
    for model in status["models"]:
        for replica in model["replicas"]:
            if replica["restarts"]:
                out[f"{model['key']}-{replica['index']}"] = replica["restarts"]
    return out


def report(rows: list[dict[str, object]], cold: list[dict[str, object]]) -> str:
    lines = [
        "| process | RSS after warm-up (MiB) | RSS at the end (MiB) | growth | fds start → end (max) |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        if "growth_pct" not in row:
            continue
        lines.append(
            f"| {row['process']} | {int(row['base_kib']) / 1024:.1f} | {int(row['last_kib']) / 1024:.1f} "  # type: ignore[call-overload]
            f"| {row['growth_pct']:+.2f} % | {row['fds_first']} → {row['fds_last']} ({row['fds_max']}) |"
        )
    if cold:
        peaks = [int(r["max_kib"]) / 1024 for r in cold]  # type: ignore[call-overload]
        lines.append(
            f"| cold replica ({len(cold)} wakes, a new process each) | first wake peak {peaks[0]:.1f} "
            f"| last wake peak {peaks[-1]:.1f} | max {max(peaks):.1f} | - |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=3600.0, help="how long the load runs")
    ap.add_argument("--rps", type=float, default=3.0, help="steady requests/s (cold pairs come on top)")
    ap.add_argument("--cold-every", type=float, default=45.0, help="seconds between cold pairs (> idleTimeout 15)")
    ap.add_argument("--rotate-every", type=float, default=300.0, help="seconds between key rotations")
    ap.add_argument("--sample-every", type=float, default=10.0, help="seconds between RSS samples")
    ap.add_argument("--json", type=Path, default=None, help="also write samples and results here as JSON")
    args = ap.parse_args()
    # Stopped early (`kill`): stop `up` and its processes on the way out, as Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    print(f"# bench_soak {git_state()} load before {loadavg()} {vars(args)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="wg-soak-") as tmp_name:
        tmp = Path(tmp_name)
        for name in ADAPTERS:
            (tmp / "adapters" / name).mkdir(parents=True)
            (tmp / "adapters" / name / "adapter_config.json").write_text("{}")
        keys = Keys(tmp / "keys.txt")
        up = UpProcess(tmp, models_yaml(), "--api-keys-file", str(keys.path))
        tally = Tally()
        samples: list[Sample] = []
        stop = threading.Event()
        try:
            up.wait_ready({"warm": 1, "lora": 1}, timeout=180)
            load = Load(up, keys, tally, rps=args.rps, cold_every=args.cold_every)
            loader = threading.Thread(target=load.run, daemon=True)

            def rotate() -> None:
                while not stop.wait(args.rotate_every):
                    keys.rotate(stop, grace=5.0)

            rotator = threading.Thread(target=rotate, daemon=True)
            t0 = time.monotonic()
            loader.start()
            rotator.start()
            while (now := time.monotonic() - t0) < args.seconds:
                samples.append(sample(up, now))
                s = samples[-1]
                print(
                    json.dumps(
                        {
                            "t": s.t,
                            "load": s.load,
                            "sent": sum(tally.sent.values()),
                            "failed": sum(tally.failed.values()),
                            "rss_mib": {n: round(p[1] / 1024, 1) for n, p in s.procs.items()},
                        }
                    ),
                    flush=True,
                )
                time.sleep(max(0.0, args.sample_every - (time.monotonic() - t0 - now)))
            samples.append(sample(up, time.monotonic() - t0))
            load.stop.set()
            stop.set()
            loader.join(120)
            rotator.join(30)
            restarted = restarts(up)
            errors = log_errors(up)
        finally:
            code = up.stop(timeout=60)
    rows = growth(samples, args.seconds)
    steady = [r for r in rows if not str(r["process"]).startswith("cold-")]
    cold = [r for r in rows if str(r["process"]).startswith("cold-")]
    failed = sum(tally.failed.values())
    worst = max((abs(float(r["growth_pct"])) for r in steady if "growth_pct" in r), default=0.0)  # type: ignore[arg-type]
    result = {
        "seconds": args.seconds,
        "requests": dict(tally.sent),
        "failed": dict(tally.failed),
        "failure_examples": tally.examples,
        "slowest_s": tally.slowest,
        "key_rotations": keys.rotations,
        "cold_wakes": len(cold),
        "restarts": restarted,
        "log_errors": errors[:50],
        "log_error_count": len(errors),
        "exit_code": code,
        "load_min_mean_max": [
            min(s.load for s in samples),
            round(statistics.mean(s.load for s in samples), 2),
            max(s.load for s in samples),
        ],
        "processes": rows,
    }
    print(f"# load after {loadavg()}")
    print(json.dumps({k: v for k, v in result.items() if k != "processes"}, indent=1))
    print()
    print(report(steady, cold))
    print()
    print(
        f"requests {sum(tally.sent.values())}, failed {failed}, log errors {len(errors)}, restarts {restarted}, "
        f"exit {code}; largest RSS growth {worst:.2f} % (target < 5 %)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps({**result, "samples": [vars(s) for s in samples]}, indent=1))
    return 0 if failed == 0 and not errors and not restarted and worst < 5 else 1


if __name__ == "__main__":
    sys.exit(main())
