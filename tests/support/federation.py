"""Run `wakegate federation gateway` as a real subprocess over member gateways, for integration tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from tests.support.http import Response, get_json, request
from tests.support.processes import stop_process
from wakegate.control.admin import free_port


def federation_doc(
    members: dict[str, int],
    *,
    port: int,
    placement: str = "clusterSelector: {tier: gpu}",
    interval: float = 0.5,
    template: str = "backend: sim, servedName: org/chat, aliases: [small]",
    token_files: bool = False,
    api_keys_file: str | None = None,
) -> str:
    """Cluster documents for `members` (name -> member gateway port on 127.0.0.1), a FederatedModel
    `chat` with `placement`, and the GlobalProxy on `port`. `token_files`: each member's token is
    in `<name>.token` beside the file; `api_keys_file`: the global gateway's client keys."""
    docs = [
        f"""apiVersion: wakegate.io/v1alpha1
kind: Cluster
metadata: {{name: {name}, labels: {{tier: gpu}}}}
spec: {{gateway: {{url: "http://127.0.0.1:{member_port}"{f", tokenFile: {name}.token" if token_files else ""}}}}}
"""
        for name, member_port in members.items()
    ]
    docs.append(f"""apiVersion: wakegate.io/v1alpha1
kind: FederatedModel
metadata: {{name: chat}}
spec:
  template: {{{template}}}
  placement: {{{placement}}}
""")
    docs.append(
        f"""apiVersion: wakegate.io/v1alpha1
kind: GlobalProxy
metadata: {{name: global}}
spec:
  listeners: [{{address: 127.0.0.1, port: {port}}}]
  healthCheck: {{intervalSeconds: {interval}, timeoutSeconds: {interval}}}
"""
        + (f"  auth: {{apiKeysFile: {api_keys_file}}}\n" if api_keys_file else "")
    )
    return "---\n".join(docs)


class GlobalProcess:
    """`wakegate federation gateway` with its own ports and state dir: from a file of documents
    (`document(port)`), or from wherever `source(port)`'s arguments say (`--proxy NS/NAME …`)."""

    def __init__(
        self,
        tmp: Path,
        document: Callable[[int], str] | None = None,
        source: Callable[[int], list[str]] | None = None,
    ) -> None:
        self.port = free_port()
        self.admin_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if document is not None:
            file = tmp / "global.yaml"
            file.write_text(document(self.port))
            args = ["-f", str(file)]
        else:
            assert source is not None, "a document or a source"
            args = source(self.port)
        self.envoy_admin = tmp / "global-state" / "run" / "envoy-admin.sock"
        self.log_path = tmp / "global.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "wakegate", "federation", "gateway", *args,
                "--admin-listen", f"127.0.0.1:{self.admin_port}", "--state-dir", str(tmp / "global-state"),
                "--upstream-header",
            ],
            cwd=tmp,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )  # fmt: skip

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def status(self) -> dict[str, Any]:
        return get_json(f"http://127.0.0.1:{self.admin_port}/status")  # type: ignore[no-any-return]

    def envoy_stats(self, pattern: str) -> dict[str, int]:
        """Counters of the global Envoy matching `pattern` (a regex), from its owner-only admin socket."""
        with socket.socket(socket.AF_UNIX) as conn:
            conn.connect(str(self.envoy_admin))
            conn.sendall(
                f"GET /stats?filter={quote(pattern)} HTTP/1.1\r\nhost: envoy\r\nconnection: close\r\n\r\n".encode()
            )
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
        body = data.partition(b"\r\n\r\n")[2].decode()
        return {k: int(v) for k, _, v in (line.partition(": ") for line in body.splitlines()) if v.isdigit()}

    def wait_for(self, check: Callable[[dict[str, Any]], bool], timeout: float = 60.0) -> dict[str, Any]:
        """Wait until the global gateway serves and `check(status)` holds."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the global gateway exited with {self.proc.returncode}:\n{self.log()}")
            try:
                last = self.status()
                if "serving on" in self.log() and check(last):
                    return last  # type: ignore[no-any-return]
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.05)
        raise AssertionError(f"not so in {timeout}s: {last}\n{self.log()}")

    def stop(self, timeout: float = 30.0) -> int:
        return stop_process(self.proc, self._log, signal.SIGTERM, timeout)


def refused_at_start(manifest: Path, state_dir: Path) -> subprocess.CompletedProcess[str]:
    """Run `wakegate federation gateway -f MANIFEST` expecting a refusal at start: exit status 2,
    one line on stderr that names the command, and nothing started or written under `state_dir`.
    Returns the finished process for the caller's own checks of that line."""
    done = subprocess.run(
        [sys.executable, "-m", "wakegate", "federation", "gateway", "-f", str(manifest), "--state-dir", str(state_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("wakegate federation: "), done.stderr
    assert not state_dir.exists()  # nothing started, nothing written
    return done


def member_port(response: Response) -> int:
    """The member gateway that answered `response` through a global gateway started with
    `--upstream-header`: its port."""
    return int(response.headers["x-wakegate-upstream"].rsplit(":", 1)[1])


def chat(url: str, model: str) -> Response:
    """One small chat completion of `model` through the gateway at `url`."""
    return request(
        "POST",
        f"{url}/v1/chat/completions",
        body={"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4},
        timeout=60,
    )
