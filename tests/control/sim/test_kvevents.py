"""`wakegate sim --kv-events-config`: vLLM-shaped KV events off the sim's prefix cache, over real ZMQ."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import zmq

from tests.support import REPO_ROOT
from tests.support.sim import SimFactory
from wakegate.control.admin import free_port
from wakegate.control.sim.events import resolve_endpoint
from wakegate.kvevents import Removed, Stored, block_hashes, decode_batch, seq_of


def post(url: str, body: dict[str, object]) -> None:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        resp.read()


def test_stores_and_evictions_are_published_in_order_with_their_chain(sim_factory: SimFactory) -> None:
    events = free_port()
    config = json.dumps(
        {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}", "topic": "kv-events"}
    )
    sim = sim_factory("--kv-cache-tokens", "64", "--kv-events-config", config)  # 4 blocks
    assert f"sim kv events endpoint=tcp://*:{events} replay=- topic=kv-events" in sim.log()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(f"tcp://127.0.0.1:{events}")
    time.sleep(0.3)
    try:
        first = [f"a{i}" for i in range(40)]  # 2 full prompt blocks, 3 blocks with the answer
        second = [f"b{i}" for i in range(40)]
        for tokens in (first, second):
            post(f"{sim.base_url}/completions", {"prompt": " ".join(tokens), "max_tokens": 4})
        got = []
        seqs = []
        while len(got) < 3:
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv-events"
            seqs.append(seq_of(seq))
            got += decode_batch(payload)[1]
    finally:
        sub.close(0)
        ctx.term()
    a, b = block_hashes(first), block_hashes(second)
    assert seqs == list(range(len(seqs)))  # one counter, from 0
    # the first prompt's 2 blocks, chained from the root. When it ends they stay cached and its
    # third (the answer's partial block) is freed: 2 of 4 blocks empty. The second needs 3, so one
    # cached block is evicted, the first prompt's tail (the end of a prompt goes before its start)
    assert got[0] == Stored(tuple(a), None)
    assert got[1] == Removed((a[1],))
    assert got[2] == Stored(tuple(b), None)


def test_a_relative_port_is_the_http_port_plus_n() -> None:
    assert resolve_endpoint("tcp://*:+1", 8000) == "tcp://*:8001"
    assert resolve_endpoint("tcp://*:5557", 8000) == "tcp://*:5557"
    assert resolve_endpoint("ipc:///tmp/kv", 8000) == "ipc:///tmp/kv"


def test_a_bad_kv_events_config_is_one_clear_error() -> None:
    for config, word in (('{"endpont": "tcp://*:1"}', "endpont"), ("{", "not JSON")):
        proc = subprocess.run(
            [sys.executable, "-m", "wakegate", "sim", "--port", "0", "--kv-events-config", config],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode != 0
        assert word in proc.stderr and "Traceback" not in proc.stderr
    busy = free_port()
    with socket_bound(busy):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "wakegate",
                "sim",
                "--port",
                "0",
                "--kv-events-config",
                json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{busy}"}),
            ],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert proc.returncode != 0
    assert "cannot open the KV events endpoint" in proc.stderr and "Traceback" not in proc.stderr


class socket_bound:
    """Hold a TCP port bound (and listening) for the block's duration."""

    def __init__(self, port: int) -> None:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("0.0.0.0", port))
        self.sock.listen()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self.sock.close()
