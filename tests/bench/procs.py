"""The processes a benchmark starts and the CPU they use: started and stopped with their children,
waited for, read from /proc.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")

# -- processes ----------------------------------------------------------------------------------


class Proc:
    """A child in its own process group, logged to a file, stopped by group."""

    def __init__(self, name: str, argv: list[str], log_path: Path, cwd: Path | None = None) -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self, tail: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-tail:]
        return ""

    def _killpg(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def stop(self, grace: float = 10.0, *, group_term: bool = True) -> int | None:
        """SIGTERM (the group, or only the leader when it drains its own children), then SIGKILL."""
        if self.alive():
            if group_term:
                self._killpg(signal.SIGTERM)
            else:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self._killpg(signal.SIGKILL)
                self.proc.wait()
        self._killpg(signal.SIGKILL)  # anything left in the group
        self._log.close()
        return self.proc.returncode


def wait_until(check: Any, what: str, timeout: float, procs: list[Proc]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if not p.alive():
                code = p.proc.returncode
                raise RuntimeError(f"{p.name} exited with {code} while waiting for {what}:\n{p.log()}")
        with contextlib.suppress(OSError, ValueError, urllib.error.URLError):
            if check():
                return
        time.sleep(0.1)
    logs = "\n".join(f"--- {p.name}\n{p.log()}" for p in procs)
    raise RuntimeError(f"timed out after {timeout}s waiting for {what}\n{logs}")


def http(url: str, body: str | None = None, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    data = body.encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers or {}, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                found.append(int(entry))
    return found


def cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return ""


def proc_mem(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM (peak RSS) in MiB; empty once the process is gone."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024
    return out


def open_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


# -- CPU accounting -----------------------------------------------------------------------------


def proc_ticks(pid: int) -> int | None:
    """utime + stime of a process (all its threads), in clock ticks."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process, seconds; None once it is gone."""
    ticks = proc_ticks(pid)
    return None if ticks is None else ticks / CLK_TCK


def machine_ticks() -> tuple[int, int]:
    """(busy, total) ticks over all CPUs from /proc/stat."""
    parts = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = parts[3] + parts[4]  # idle + iowait
    total = sum(parts[:8])  # without guest, counted in user already
    return total - idle, total


class CpuMeter:
    """CPU used by named processes, and by the whole machine, between start() and stop()."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.p0 = {name: proc_ticks(pid) for name, pid in self.pids.items()}
        self.m0 = machine_ticks()

    def stop(self, wrk_ticks: int | None = None) -> dict[str, float]:
        wall = time.monotonic() - self.t0
        out: dict[str, float] = {}
        ours = 0.0
        for name, pid in self.pids.items():
            now, before = proc_ticks(pid), self.p0.get(name)
            if now is None or before is None:
                continue
            pct = 100.0 * (now - before) / CLK_TCK / wall
            out[name] = round(pct, 1)
            ours += pct
        if wrk_ticks is not None:
            out["wrk"] = round(100.0 * wrk_ticks / CLK_TCK / wall, 1)
            ours += out["wrk"]
        busy1, total1 = machine_ticks()
        busy, total = busy1 - self.m0[0], total1 - self.m0[1]
        ncpu = os.cpu_count() or 1
        machine = 100.0 * ncpu * busy / total if total else 0.0  # in "% of one core" units
        out["machine_busy"] = round(machine, 1)
        out["other_load"] = round(max(0.0, machine - ours), 1)
        return out
