"""Run `wakegate up` as a real subprocess on free loopback ports, for integration tests."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
import urllib.error
from pathlib import Path
from typing import Any

from tests.support.http import get_json
from tests.support.processes import stop_process
from wakegate.control.admin import free_port


class UpProcess:
    """`wakegate up -f models.yaml` with its own ports and state dir."""

    def __init__(
        self,
        tmp: Path,
        models_yaml: str,
        *extra: str,
        env: dict[str, str] | None = None,
        port: int | None = None,
        nofile: int | None = None,
    ) -> None:
        """`nofile`: run `up` (and so its children) under this file-descriptor limit, soft and hard."""
        self.tmp = tmp
        self.port = port or free_port()
        self.admin_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = f"{self.url}/v1"
        self.models_file = tmp / "models.yaml"
        self.models_file.write_text(models_yaml)
        self.state_dir = tmp / "state"
        #: Envoy's admin address (HOST:PORT) where the test passed `--envoy-admin-listen`, else "".
        self.envoy_admin = ""
        self.log_path = tmp / "up.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "wakegate",
                "up",
                "-f",
                str(self.models_file),
                "--listen",
                f"127.0.0.1:{self.port}",
                "--admin-listen",
                f"127.0.0.1:{self.admin_port}",
                "--state-dir",
                str(self.state_dir),
                "--upstream-header",
                *extra,
            ],
            cwd=tmp,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
            preexec_fn=None if nofile is None else lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)),
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def status(self) -> dict[str, Any]:
        return get_json(f"http://127.0.0.1:{self.admin_port}/status")  # type: ignore[no-any-return]

    def child_arg(self, component: str, flag: str) -> str:
        """The value `up` gave `flag` on the command line of its child `component` ("extproc-0", …)."""
        pid = self.status()["components"][component]["pid"]
        argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        return argv[argv.index(flag) + 1]

    def wait_ready(self, ready: dict[str, int] | None = None, timeout: float = 60.0) -> None:
        """Wait for the gateway to serve and each model to have the given number of ready replicas."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"wakegate up exited with {self.proc.returncode}:\n{self.log()}")
            try:
                last = self.status()
                counts = {m["key"]: m["ready"] for m in last["models"]}
                want = ready if ready is not None else {}
                if all(counts.get(k) == v for k, v in want.items()) and "serving on" in self.log():
                    return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.1)
        raise AssertionError(f"not ready in {timeout}s: {last}\n{self.log()}")

    def endpoints(self, key: str) -> list[str]:
        for model in self.status()["models"]:
            if model["key"] == key:
                return [f"127.0.0.1:{r['port']}" for r in model["replicas"] if r["state"] == "ready"]
        raise KeyError(key)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        return stop_process(self.proc, self._log, sig, timeout)


def model_doc(name: str, *, backend: str = "sim", extra: str = "") -> str:
    return f"""---
apiVersion: wakegate.io/v1alpha1
kind: Model
metadata:
  name: {name}
spec:
  backend: {backend}
{extra}"""


def adapter_doc(name: str, base: str, source: str, served_name: str | None = None) -> str:
    """A LoRAAdapter document of `base` with its weights at `source`."""
    served = f", servedName: {served_name}" if served_name else ""
    return f"""---
apiVersion: wakegate.io/v1alpha1
kind: LoRAAdapter
metadata: {{name: {name}}}
spec: {{baseModel: {base}, source: "{source}"{served}}}
"""


def pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        # a zombie still answers kill(0); check its state
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split()[2]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive
