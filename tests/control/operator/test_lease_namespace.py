"""`wakegate operator` with a kubeconfig only and a lease namespace that does not exist: it stops at
once with one clear line and exit code 2 (it used to warn every 5 s forever and never reconcile).

A real `wakegate operator` process talks to a stand-in API server on loopback that answers as
kube-apiserver does when the namespace is missing (404 to the Lease's GET and POST).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest


class _NoNamespace(BaseHTTPRequestHandler):
    seen: list[str] = []

    def _answer(self) -> None:
        self.seen.append(f"{self.command} {self.path}")
        length = int(self.headers.get("content-length") or 0)
        if length:
            self.rfile.read(length)
        body = json.dumps(
            {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "reason": "NotFound",
                "code": 404,
                "message": 'namespaces "wakegate-nowhere" not found',
            }
        ).encode()
        self.send_response(404)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_PATCH = _answer

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def apiserver() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NoNamespace)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_missing_lease_namespace_exits_2_with_one_line(apiserver: str, tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": apiserver}}],
                "users": [{"name": "u", "user": {}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u", "namespace": "default"}}],
                "current-context": "x",
            }
        )
    )
    _NoNamespace.seen.clear()
    done = subprocess.run(
        [sys.executable, "-m", "wakegate", "operator", "--kubeconfig", str(kubeconfig),
         "--lease-namespace", "wakegate-nowhere", "--renew-seconds", "0.2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1, done.stderr
    assert "'wakegate-nowhere' does not exist" in errors[0] and "--lease-namespace" in errors[0]
    assert "Traceback" not in done.stderr
    assert [s for s in _NoNamespace.seen if s.startswith("POST")] == [
        "POST /apis/coordination.k8s.io/v1/namespaces/wakegate-nowhere/leases"
    ]  # one attempt, not a retry loop
