"""Stopping a process a test started, the one way every test and benchmark does it."""

from __future__ import annotations

import contextlib
import signal
import subprocess
from typing import IO, Any


def stop_process(
    proc: subprocess.Popen[Any], log: IO[bytes] | None = None, sig: int = signal.SIGTERM, timeout: float = 30.0
) -> int:
    """Send `sig` to `proc` if it still runs, SIGKILL it if it has not exited after `timeout`
    seconds, close its `log`; return its exit status."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if log is not None:
        with contextlib.suppress(OSError):
            log.close()
    return int(proc.returncode)
