"""In-flight counts are exact although extproc lets go of each request once it is decided.

Completions come from Envoy's access log (extproc/completions.py); these requests go
through the real gateway and read the count back from `wakegate up`'s /status (what the
scaler's idle detection reads). The native model's requests never reach extproc: there the
count is Envoy's own (polled from its admin API), and must be as exact.
"""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from tests.gateway.conftest import API_KEY, NATIVE
from tests.support.up import UpProcess

HEADERS = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}


def in_flight(gateway: UpProcess, key: str) -> int:
    return next(int(m["in_flight"]) for m in gateway.status()["models"] if m["key"] == key)


def wait_for(gateway: UpProcess, key: str, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (seen := in_flight(gateway, key)) != count:
        assert time.monotonic() < deadline, f"in_flight of {key} stayed {seen}, expected {count}"
        time.sleep(0.05)


BOTH = pytest.mark.parametrize("key", ["chat-l", NATIVE])  # decided, native (both 50 tokens/s)


def open_stream(gateway: UpProcess, tokens: int, key: str) -> http.client.HTTPConnection:
    body = {"model": key, "stream": True, "max_tokens": tokens, "messages": [{"role": "user", "content": "x"}]}
    conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), HEADERS)
    assert conn.getresponse().status == 200
    return conn


@BOTH
def test_streams_count_while_they_run_and_not_after(gateway: UpProcess, key: str) -> None:
    wait_for(gateway, key, 0)
    streams = [open_stream(gateway, 200, key) for _ in range(4)]  # 4 s each at 50 tokens/s
    wait_for(gateway, key, 4)
    # A client that goes away mid-stream releases its request as well.
    streams.pop().close()
    wait_for(gateway, key, 3)
    for conn in streams:
        conn.close()
    wait_for(gateway, key, 0)


@BOTH
def test_many_concurrent_short_requests_leave_nothing_counted(gateway: UpProcess, key: str) -> None:
    errors: list[str] = []

    def worker(n: int) -> None:
        body = {"model": key, "max_tokens": 1, "messages": [{"role": "user", "content": f"q{n}"}]}
        for _ in range(15):
            conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=30)
            try:
                conn.request("POST", "/v1/chat/completions", json.dumps(body), HEADERS)
                response = conn.getresponse()
                response.read()
                if response.status != 200:
                    errors.append(str(response.status))
            finally:
                conn.close()

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    wait_for(gateway, key, 0)


@BOTH
def test_a_client_sent_request_id_cannot_confuse_the_counts(gateway: UpProcess, key: str) -> None:
    """Envoy assigns every request id itself; two requests that bring the same one are both counted and released."""
    wait_for(gateway, key, 0)
    body = {"model": key, "stream": True, "max_tokens": 150, "messages": [{"role": "user", "content": "x"}]}
    conns = []
    for _ in range(2):
        conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=30)
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {**HEADERS, "x-request-id": "same"})
        assert conn.getresponse().status == 200
        conns.append(conn)
    wait_for(gateway, key, 2)
    for conn in conns:
        conn.close()
    wait_for(gateway, key, 0)
