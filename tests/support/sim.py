"""`wakegate sim` as a real subprocess.

``start_sim(port, *args)`` starts ``python -m wakegate sim --port PORT ARGS`` and,
unless ``wait_ready=False``, waits until its ``/health`` answers 200. The returned
:class:`SimProcess` knows its ``.url`` (``http://127.0.0.1:PORT``), ``.base_url``
(``.../v1``), ``.port`` and ``.log()`` (its stderr so far), and ``.stop()`` sends
SIGTERM and waits. The sim tests get the ``sim_factory`` fixture (tests/control/sim/conftest.py),
which stops whatever it started at teardown.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from tests.support import REPO_ROOT
from tests.support.processes import stop_process
from wakegate.control.admin import free_port


def http_status(url: str, timeout: float = 1.0) -> int | None:
    """The status of a GET, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None


class SimProcess:
    def __init__(self, port: int, args: tuple[str, ...]) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.base_url = f"{self.url}/v1"
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("VLLM_API_KEY", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "wakegate", "sim", "--port", str(port), *args],
            cwd=REPO_ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def status(self, path: str, timeout: float = 1.0) -> int | None:
        """The status of ``GET url+path``, or None when nothing answers."""
        return http_status(f"{self.url}{path}", timeout=timeout)

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def wait_listening(self, timeout: float = 10.0) -> None:
        """Wait until the port answers HTTP at all (any status)."""
        self._wait(lambda status: status is not None, timeout, "listening")

    def wait_healthy(self, timeout: float = 10.0) -> None:
        self._wait(lambda status: status == 200, timeout, "healthy")

    def _wait(self, ok: Callable[[int | None], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sim exited with {self.proc.returncode}:\n{self.log()}")
            if ok(http_status(f"{self.url}/health", timeout=0.5)):
                return
            time.sleep(0.02)
        raise TimeoutError(f"sim not {what} after {timeout}s:\n{self.log()}")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float = 10.0) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, wait; SIGKILL if it does not exit in time. Returns the exit status."""
        return stop_process(self.proc, self._log, timeout=timeout)


def start_sim(port: int, *args: str, wait_ready: bool = True, timeout: float = 10.0) -> SimProcess:
    """Start a sim on ``port`` (0: a free one) with extra CLI ``args``."""
    sim = SimProcess(port or free_port(), args)
    try:
        if wait_ready:
            sim.wait_healthy(timeout)
        else:
            sim.wait_listening(timeout)
    except BaseException:
        sim.stop(timeout=2)
        raise
    return sim


SimFactory = Callable[..., SimProcess]
