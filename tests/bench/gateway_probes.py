"""What the benchmarks read of a running `wakegate up` gateway: its Envoy and extproc processes,
Envoy's allocator and its counters (from the admin port `up` was given with
`--envoy-admin-listen`)."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from tests.bench.procs import children_of, cmdline
from tests.support.up import UpProcess

ENVOY_STATS = r"http2\.|ext_proc|_overflow|cx_connect_fail|destroy_remote_with_active_rq|rq_timeout|overload"


def envoy_allocated_mib(up: UpProcess) -> float | None:
    """What Envoy's allocator holds (`/memory` on its admin port), in MiB: its heap without the
    allocator's free pages and the binary, so held requests' cost shows apart from RSS noise."""
    found = re.search(r"envoy_admin=127\.0\.0\.1:(\d+)", up.log())
    if not found:
        return None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{found.group(1)}/memory", timeout=5) as r:
            return round(int(json.loads(r.read())["allocated"]) / 2**20, 2)
    except (urllib.error.URLError, OSError, KeyError, ValueError):
        return None


def envoy_stats(up: UpProcess) -> dict[str, int]:
    """Non-zero Envoy counters about HTTP/2 codec errors, ext_proc, overflows (from the admin port)."""
    found = re.search(r"envoy_admin=127\.0\.0\.1:(\d+)", up.log())
    if not found:
        return {}
    url = f"http://127.0.0.1:{found.group(1)}/stats?usedonly&filter={urllib.parse.quote(ENVOY_STATS)}"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError):
        return {}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if value.strip().isdigit() and int(value):
            out[name] = int(value)
    return out


def gateway_pids(up: UpProcess) -> dict[str, int]:
    pids: dict[str, int] = {}
    for pid in children_of(up.proc.pid):
        cmd = cmdline(pid)
        if Path(cmd.split(" ")[0]).name == "envoy" or "envoy.yaml" in cmd:
            pids["envoy"] = pid
        elif "wakegate.extproc" in cmd and "extproc-1" not in cmd:
            pids["extproc"] = pid  # the active one; extproc-1 is the standby
    return pids
