"""Load from wrk: the chat completion it sends, its Lua request scripts, its runs and what they measured."""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tests.bench.procs import CLK_TCK

MODEL = "bench-model"


def chat_body(model: str) -> str:
    return json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}, separators=(",", ":")
    )


BODY = chat_body(MODEL)


# -- wrk ----------------------------------------------------------------------------------------

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m|h)", text.strip())
    if not m:
        raise ValueError(f"cannot parse wrk latency {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


@dataclass
class WrkResult:
    path: str
    connections: int
    duration_s: float
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    non_2xx: int
    socket_errors: dict[str, int]
    cpu: dict[str, float] = field(default_factory=dict)
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)

    @property
    def errors(self) -> int:
        return self.non_2xx + sum(self.socket_errors.values())

    @property
    def cpu_us_per_request(self) -> float:
        """CPU of the processes on this path (wrk included), per request, in microseconds."""
        ours = sum(v for k, v in self.cpu.items() if k not in ("machine_busy", "other_load"))
        return ours / 100.0 / self.rps * 1e6 if self.rps else float("nan")


def parse_wrk(path: str, connections: int, duration: float, out: str) -> WrkResult:
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    p50 = re.search(r"^\s+50%\s+(\S+)", out, re.M)
    p99 = re.search(r"^\s+99%\s+(\S+)", out, re.M)
    reqs = re.search(r"(\d+) requests in", out)
    if not (rps and p50 and p99 and reqs):
        raise RuntimeError(f"cannot parse wrk output for {path}:\n{out}")
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    socket_errors = (
        dict(zip(("connect", "read", "write", "timeout"), map(int, sock.groups()), strict=True))
        if sock
        else {"connect": 0, "read": 0, "write": 0, "timeout": 0}
    )
    return WrkResult(
        path=path,
        connections=connections,
        duration_s=duration,
        rps=float(rps.group(1)),
        p50_ms=_ms(p50.group(1)),
        p99_ms=_ms(p99.group(1)),
        requests=int(reqs.group(1)),
        non_2xx=int(non2xx.group(1)) if non2xx else 0,
        socket_errors=socket_errors,
    )


def lua_script(directory: Path, name: str, extra_headers: dict[str, str], body: str = BODY) -> Path:
    lines = [
        'wrk.method = "POST"',
        f"wrk.body = {json.dumps(body)}",
        'wrk.headers["Content-Type"] = "application/json"',
        *(f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}" for k, v in extra_headers.items()),
    ]
    path = directory / name
    path.write_text("\n".join(lines) + "\n")
    return path


def run_wrk(
    wrk: str, url: str, script: Path, connections: int, duration: float, *, latency: bool = True
) -> tuple[str, int]:
    """Run wrk; returns (stdout, CPU ticks wrk used)."""
    argv = [wrk, "-t1", f"-c{connections}", f"-d{duration:g}s", "-s", str(script), url]
    if latency:
        argv.insert(4, "--latency")
    before = os.times()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 60, check=False)
    after = os.times()
    ticks = round(
        ((after.children_user - before.children_user) + (after.children_system - before.children_system)) * CLK_TCK
    )
    if done.returncode != 0:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr}\n{done.stdout}")
    return done.stdout, ticks
