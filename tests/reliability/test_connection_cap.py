"""Envoy under a low file-descriptor limit: clients past the cap are refused, the gateway stays up.

Envoy 1.40 crashes (SIGSEGV) when it cannot open a socket for lack of descriptors. `up` raises its
soft limit to the hard one and caps Envoy's client connections at what its limit leaves after a
reserve (`wakegate.control.bootstrap.downstream_cap`), so a flood of connections is
refused at the cap instead.
"""

from __future__ import annotations

import contextlib
import socket
import time
from pathlib import Path

from tests.support.http import envoy_stat, request
from tests.support.up import UpProcess, model_doc
from wakegate.control import bootstrap
from wakegate.control.admin import free_port

NOFILE = 4600  # a cap of 504 client connections


def chat(up: UpProcess) -> int:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return request("POST", f"{up.base_url}/chat/completions", body=body, timeout=30).status


def served_within(up: UpProcess, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if chat(up) == 200:
                return True
        time.sleep(0.2)
    return False


def test_a_connection_flood_past_the_cap_is_refused_and_envoy_stays_up(tmp_path: Path) -> None:
    cap = bootstrap.downstream_cap(50000, NOFILE)
    assert cap == NOFILE - 4096
    admin = f"127.0.0.1:{free_port()}"
    up = UpProcess(tmp_path, model_doc("m"), "--envoy-admin-listen", admin, nofile=NOFILE)
    flood: list[socket.socket] = []
    try:
        up.wait_ready({"m": 1}, timeout=60)
        envoy = up.status()["components"]["envoy"]["pid"]
        assert chat(up) == 200
        # More connections than Envoy has descriptors for: without the cap it would run out.
        for _ in range(NOFILE + 200):
            with contextlib.suppress(OSError):
                flood.append(socket.create_connection(("127.0.0.1", up.port), timeout=5))
        listener = f"listener.127.0.0.1_{up.port}.downstream_global_cx_overflow"
        assert envoy_stat(admin, listener) > 0
        for conn in flood:
            conn.close()
        flood.clear()
        # Envoy frees the slots as it sees the closes; then new clients are served again.
        assert served_within(up, 10.0)
        assert up.status()["components"]["envoy"]["pid"] == envoy, "Envoy restarted"
        assert "Too many open files" not in (up.state_dir / "logs" / "envoy.log").read_text()
    finally:
        for conn in flood:
            conn.close()
        assert up.stop() == 0, up.log()[-3000:]
