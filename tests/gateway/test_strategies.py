"""Each routing strategy's property, over many requests through the real gateway to several sims.

The gateway runs with --upstream-header, so every response names the backend that served it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time

import pytest

from tests.gateway.conftest import API_KEY, NATIVE_LEAST, extproc_streams, routing_path
from tests.support.http import request
from tests.support.up import UpProcess

AUTH = {"authorization": f"Bearer {API_KEY}"}


def served_by(gateway: UpProcess, body: dict[str, object], headers: dict[str, str] | None = None) -> str:
    response = request("POST", f"{gateway.url}/v1/chat/completions", body=body, headers={**AUTH, **(headers or {})})
    assert response.status == 200, response.text
    return response.headers["x-wakegate-upstream"]


def chat(model: str, *messages: str, **extra: object) -> dict[str, object]:
    return {
        "model": model,
        "max_tokens": 1,
        "messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": m} for i, m in enumerate(messages)],
        **extra,
    }


def test_default_spreads_over_all_endpoints(gateway: UpProcess) -> None:
    seen = collections.Counter(served_by(gateway, chat("chat-a", f"q{i}")) for i in range(40))
    assert set(seen) == set(gateway.endpoints("chat-a"))


def test_a_model_naming_no_routing_keeps_a_shared_prompt_where_its_cache_is(gateway: UpProcess) -> None:
    system = "default profile system prompt " * 300  # several prefix blocks
    # chat-a names no routing: the default profile (balanced) keeps the prompt on one replica
    homes = {served_by(gateway, chat("chat-a", system, "ok", f"q{i}")) for i in range(6)}
    assert len(homes) == 1
    # chat-o asks for Envoy's round robin: the same prompt goes round every replica
    seen = collections.Counter(served_by(gateway, chat("chat-o", system, "ok", f"q{i}")) for i in range(6))
    assert set(seen) == set(gateway.endpoints("chat-o"))


def test_session_affinity_keeps_each_session_on_one_endpoint(gateway: UpProcess) -> None:
    endpoints = set(gateway.endpoints("chat-b"))
    per_session: dict[str, set[str]] = collections.defaultdict(set)
    for round_ in range(3):
        for s in range(40):
            per_session[f"s{s}"].add(served_by(gateway, chat("chat-b", f"turn {round_}"), {"x-session-id": f"s{s}"}))
    assert all(len(eps) == 1 for eps in per_session.values()), per_session
    load = collections.Counter(next(iter(eps)) for eps in per_session.values())
    assert set(load) == endpoints, "sessions should spread over every endpoint"
    assert min(load.values()) >= 4


def test_session_affinity_from_body_and_conversation(gateway: UpProcess) -> None:
    # Without a session header, the first messages identify the conversation.
    first = served_by(gateway, chat("chat-b", "a long-running conversation opener"))
    for _ in range(5):
        assert served_by(gateway, chat("chat-b", "a long-running conversation opener")) == first
    by_body = {served_by(gateway, chat("chat-b", f"x{i}", session_id="sess-body-1")) for i in range(6)}
    assert len(by_body) == 1


def test_prefix_routes_shared_prompt_prefix_to_one_endpoint(gateway: UpProcess) -> None:
    endpoints = set(gateway.endpoints("chat-p"))
    chosen: dict[int, set[str]] = collections.defaultdict(set)
    for prompt in range(30):
        system = f"You are assistant number {prompt}. " + "Follow the house rules carefully. " * 40
        for tail in range(3):
            body = {
                "model": "chat-p",
                "max_tokens": 1,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"question {tail}"},
                ],
            }
            chosen[prompt].add(served_by(gateway, body))
    assert all(len(eps) == 1 for eps in chosen.values()), chosen
    assert set().union(*chosen.values()) == endpoints
    assert served_by(gateway, chat("chat-p", "x"), {"x-cache-key": "k1"}) == served_by(
        gateway, chat("chat-p", "y"), {"x-cache-key": "k1"}
    )


def test_balanced_profile_sends_each_system_prompt_where_its_cache_is(gateway: UpProcess) -> None:
    endpoints = gateway.endpoints("chat-s")
    homes = {}
    for k in range(4):
        system = f"system prompt number {k} " * 300  # 1 200 sim tokens, ~7 kB: several prefix blocks
        seen = {
            served_by(
                gateway,
                {
                    "model": "chat-s",
                    "max_tokens": 1,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}],
                },
            )
            for i in range(4)
        }
        assert len(seen) == 1, seen
        homes[k] = seen.pop()
    assert set(homes.values()) == set(endpoints)  # new prompts spread over the idle fleet
    # the engines agree: every repeat found its 1 200-token system prompt (75 blocks) cached
    hits = queries = 0.0
    for ep in endpoints:
        text = request("GET", f"http://{ep}/metrics").text
        hits += sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits"))
        queries += sum(
            float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:prefix_cache_queries")
        )
    assert (hits, queries) == (4 * 3 * 1200, 16 * 1201)


def test_balanced_profile_leaves_a_replica_whose_engine_reports_a_full_queue(gateway: UpProcess) -> None:
    import http.client
    import json

    endpoints = gateway.endpoints("chat-s")
    body = chat("chat-s", "q")
    body["messages"] = [{"role": "system", "content": "saturation probe " * 300}, *body["messages"]]  # type: ignore[misc]
    home = served_by(gateway, body)
    assert served_by(gateway, body) == home
    other = next(ep for ep in endpoints if ep != home)
    # Six long requests straight to the home engine, unseen by the gateway: 1 runs, 5 wait
    # (--max-concurrency 1). Only the engine's own metrics can tell the gateway.
    host, port = home.split(":")
    conns = []
    try:
        for i in range(6):
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            long_body = {"prompt": f"busy {i}", "max_tokens": 500, "stream": True}
            conn.request("POST", "/v1/completions", json.dumps(long_body), {"content-type": "application/json"})
            conns.append(conn)
        deadline = time.monotonic() + 15
        while True:
            text = request("GET", f"http://{home}/metrics").text
            waiting = sum(
                float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:num_requests_waiting{")
            )
            if waiting >= 5:
                break
            assert time.monotonic() < deadline, text
            time.sleep(0.05)
        time.sleep(2.0)  # a few of extproc's engine-metric reads (every 0.5 s)
        assert served_by(gateway, body) == other  # the prefix's home is saturated: it goes elsewhere
    finally:
        for conn in conns:
            conn.close()


def test_precise_profile_follows_the_blocks_each_engine_reports(gateway: UpProcess) -> None:
    endpoints = gateway.endpoints("chat-k")
    systems = {ep: " ".join(f"k{n}w{i}" for i in range(600)) for n, ep in enumerate(endpoints)}
    # each system prompt goes straight to one engine, unseen by the gateway: only that engine's KV
    # events can tell the gateway where its blocks are
    for ep, system in systems.items():
        direct = {"model": "chat-k", "max_tokens": 1, "messages": [{"role": "system", "content": system}]}
        assert request("POST", f"http://{ep}/v1/chat/completions", body=direct).status == 200
    time.sleep(1.0)  # events take milliseconds on loopback; a subscription replays what came before it
    homes = {
        ep: {
            served_by(
                gateway,
                {
                    "model": "chat-k",
                    "max_tokens": 1,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}],
                },
            )
            for i in range(3)
        }
        for ep, system in systems.items()
    }
    assert all(seen == {ep} for ep, seen in homes.items()), homes


@pytest.mark.parametrize("model", ["chat-l", NATIVE_LEAST], ids=["decided", "native"])
def test_least_loaded_avoids_endpoints_busy_with_long_streams(gateway: UpProcess, model: str) -> None:
    """The same on both paths: extproc's in-flight counts (decided) and Envoy's active requests
    per endpoint, compared over every endpoint (native)."""
    endpoints = gateway.endpoints(model)
    before = extproc_streams(gateway)
    # Two long streams (50 tok/s x 150 tokens = 3 s), the second sent once the first is under
    # way, occupy two endpoints...
    started = threading.Barrier(3)
    streams: list[str] = []

    def long_stream(delay: float) -> None:
        body = chat(model, "long", stream=True)
        body["max_tokens"] = 150
        started.wait()
        time.sleep(delay)
        streams.append(served_by(gateway, body))

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(long_stream, delay) for delay in (0.0, 0.3)]
        started.wait()
        time.sleep(0.8)
        # ...so short requests made meanwhile all go to the idle third one.
        short = {served_by(gateway, chat(model, f"short {i}")) for i in range(10)}
        for future in futures:
            future.result()
    assert len(set(streams)) == 2, "the two streams should have been spread"
    idle = set(endpoints) - set(streams)
    assert short == idle
    # Once the streams end, load spreads again (ties rotate in extproc, split at random in Envoy).
    after = {served_by(gateway, chat(model, f"after {i}")) for i in range(30)}
    assert after == set(endpoints)
    if model == NATIVE_LEAST:
        assert routing_path(gateway, model) == "native"
        assert extproc_streams(gateway) == before  # Envoy picked every one of them


def test_stream_is_not_buffered_first_token_arrives_early(gateway: UpProcess) -> None:
    """SSE passes through unbuffered: the first token arrives long before the stream ends."""
    import http.client
    import json

    body = chat("chat-l", "tell me a long story", stream=True)
    body["max_tokens"] = 100  # 50 tokens/s: a two-second stream
    conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=30)
    try:
        started = time.monotonic()
        conn.request(
            "POST", "/v1/chat/completions", body=json.dumps(body), headers={**AUTH, "content-type": "application/json"}
        )
        response = conn.getresponse()
        assert response.status == 200
        first_token = None
        while True:
            line = response.readline()
            if not line:
                break
            if first_token is None and b'"content":"' in line and b'"content":""' not in line:
                first_token = time.monotonic() - started
        total = time.monotonic() - started
    finally:
        conn.close()
    assert first_token is not None
    assert total >= 1.5
    assert first_token < 0.5, f"first token after {first_token:.2f}s of a {total:.2f}s stream"


def test_clients_cannot_choose_the_backend(gateway: UpProcess) -> None:
    """A client-sent endpoint-picker header is dropped (default strategy) or replaced (picked)."""
    bogus = {"x-gateway-destination-endpoint": "127.0.0.1:1"}
    for model in ("chat-a", "chat-b"):
        upstream = served_by(gateway, chat(model, "pick for me"), bogus)
        assert upstream in set(gateway.endpoints(model))
