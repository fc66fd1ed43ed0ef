"""One real gateway (Envoy + extproc + feeder + sim backends) shared by the gateway tests.

Its fleet has a model on the native path (`chat-n`: Envoy routes it alone while it is warm) beside
the decided ones, so the shared tests (OpenAI client, bad input, keys, in-flight counts) run
over both paths; `envoy_admin` lets a test read which path a request took.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.http import EXTPROC_STREAMS, envoy_stat
from tests.support.up import UpProcess, model_doc
from wakegate.control.admin import free_port

API_KEY = "sk-test-gateway-0123456789"
#: May use chat-a only (by any of its names).
SCOPED_KEY = "sk-test-scoped-a-0123456789"
#: May use chat-n (the native model) only.
SCOPED_N_KEY = "sk-test-scoped-n-0123456789"
#: The key file the shared gateway starts with; tests that rewrite it put this back.
KEYS_TEXT = f"# test keys\n{API_KEY}\n{SCOPED_KEY}  chat-a\n{SCOPED_N_KEY}  chat-n\n"
#: The model on the native path, and its decided twin where a test compares the two.
NATIVE = "chat-n"
#: chat-l's twin on the native path: least-loaded by Envoy's own least_request.
NATIVE_LEAST = "chat-nl"
MAX_BODY = 64 * 1024

FLEET = "".join(
    [
        model_doc(
            "chat-a",
            extra="""  servedName: org/chat-a
  aliases: [a, gpt-a]
  loraAdapters: [a-sql]
  scaling: {min: 2, max: 2}
""",
        ),
        model_doc(
            "chat-o",
            extra="""  routing: {strategy: round-robin}
  scaling: {min: 2, max: 2}
""",
        ),
        model_doc(
            NATIVE,
            extra="""  aliases: [n, gpt-n]
  args: [--tokens-per-second, "50"]
  routing: {strategy: round-robin, path: native}
  scaling: {min: 2, max: 2}
""",
        ),
        model_doc(
            "chat-b",
            extra="""  aliases: [b]
  routing: {strategy: session-affinity}
  scaling: {min: 3, max: 3}
""",
        ),
        model_doc(
            "chat-p",
            extra="""  routing: {strategy: prefix}
  scaling: {min: 3, max: 3}
""",
        ),
        model_doc(
            "chat-l",
            extra="""  args: [--tokens-per-second, "50"]
  routing: {strategy: least-loaded}
  scaling: {min: 3, max: 3}
""",
        ),
        model_doc(
            NATIVE_LEAST,
            extra="""  args: [--tokens-per-second, "50"]
  routing: {strategy: least-loaded, path: native}
  scaling: {min: 3, max: 3}
""",
        ),
        model_doc(
            "chat-s",
            extra="""  args: [--max-concurrency, "1", --tokens-per-second, "50"]
  routing: {profile: balanced}
  scaling: {min: 2, max: 2}
""",
        ),
        model_doc(
            "chat-k",
            extra="""  args: [--kv-events-config, '{"enable_kv_cache_events": true, "publisher": "zmq",
    "endpoint": "tcp://*:+1", "replay_endpoint": "tcp://*:+2", "topic": "kv-events"}']
  routing: {profile: precise, kvEvents: {portOffset: 1, replayPortOffset: 2}}
  scaling: {min: 3, max: 3}
""",
        ),
        model_doc(
            "chat-r",
            extra="""  limits: {requestsPerSecond: 0.5, burst: 2}
""",
        ),
        model_doc(
            "chat-z",
            extra="""  scaling: {min: 0, max: 1}
  endpoint: {coldMode: reject}
""",
        ),
        model_doc(
            "chat-cold",
            extra="""  scaling: {min: 0, max: 1}
  endpoint: {coldMode: reject}
""",
        ),
    ]
)


@pytest.fixture(scope="session")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    tmp: Path = tmp_path_factory.mktemp("gateway")
    keys = tmp / "keys.txt"
    keys.write_text(KEYS_TEXT)
    envoy_admin = f"127.0.0.1:{free_port()}"
    up = UpProcess(
        tmp, FLEET, "--api-keys-file", str(keys), "--max-body-bytes", str(MAX_BODY), "--envoy-admin-listen", envoy_admin
    )
    up.envoy_admin = envoy_admin
    try:
        up.wait_ready(
            {
                "chat-a": 2,
                "chat-o": 2,
                NATIVE: 2,
                "chat-b": 3,
                "chat-p": 3,
                "chat-l": 3,
                NATIVE_LEAST: 3,
                "chat-s": 2,
                "chat-k": 3,
                "chat-r": 1,
            },
            timeout=90,
        )
        deadline = time.monotonic() + 15
        while {routing_path(up, NATIVE), routing_path(up, NATIVE_LEAST)} != {"native"}:
            assert time.monotonic() < deadline, f"{NATIVE} never took the native path\n{up.log()}"
            time.sleep(0.1)
        yield up
    finally:
        code = up.stop()
        assert code == 0, up.log()


def routing_path(up: UpProcess, key: str) -> str:
    """The path `up`'s /status says the model takes now: native or decided."""
    return str(next(m["routingPath"] for m in up.status()["models"] if m["key"] == key))


def extproc_streams(up: UpProcess) -> int:
    """ext_proc streams the gateway's Envoy has opened so far (a native request opens none)."""
    return envoy_stat(up.envoy_admin, EXTPROC_STREAMS)


@pytest.fixture(scope="session")
def keys_file(gateway: UpProcess) -> Path:
    return gateway.tmp / "keys.txt"
