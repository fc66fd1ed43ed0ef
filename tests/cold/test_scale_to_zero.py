"""Scale to zero and back through the real gateway: hold, wake, answer, release when idle."""

from __future__ import annotations

import asyncio
import collections
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.cold.conftest import CRASH_TIMEOUT, both_paths, warm_path
from tests.support.http import envoy_stat, request
from tests.support.up import UpProcess, pids_alive
from tests.support.waiting import wait_for


def replicas(up: UpProcess, key: str) -> list[dict[str, object]]:
    for model in up.status()["models"]:
        if model["key"] == key:
            return list(model["replicas"])
    raise KeyError(key)


def path_of(up: UpProcess, key: str) -> str:
    return str(next(m for m in up.status()["models"] if m["key"] == key)["routingPath"])


def chat_body(model: str, **extra: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "wake up"}], "max_tokens": 4, **extra}


@both_paths("cold-a")
def test_cold_request_wakes_model_and_model_sleeps_after_idle(cold_gateway: UpProcess, model: str) -> None:
    up = cold_gateway
    client = openai.OpenAI(base_url=up.base_url, api_key="unused", max_retries=0, timeout=60)
    assert replicas(up, model) == []
    started = time.monotonic()
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert reply.choices[0].message.content
    assert time.monotonic() - started >= 1.5, "answered before the 2 s load could finish"
    (replica,) = replicas(up, model)
    wait_for(lambda: path_of(up, model) == warm_path(model), 5, "the warm path")
    pid = int(replica["pid"])  # type: ignore[call-overload]
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
    )
    assert len([c for c in stream if c.choices and c.choices[0].delta.content]) == 5
    # idleTimeout 3 s (+ the lease's grace after readiness): the process goes away...
    wait_for(lambda: replicas(up, model) == [], 30, f"{model} to scale to zero")
    wait_for(lambda: pids_alive([pid]) == [], 10, "the backend process to exit")
    # ...and the next request, streaming this time, brings it back.
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "again"}], max_tokens=4, stream=True
    )
    assert len([c for c in stream if c.choices and c.choices[0].delta.content]) == 4
    assert len(replicas(up, model)) == 1


@both_paths("cold-q")
async def test_overflow_beyond_max_queue_gets_429_and_the_rest_one_activation(
    cold_gateway: UpProcess, model: str
) -> None:
    up = cold_gateway
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60)
    ) as session:

        async def one(i: int) -> tuple[int, dict[str, object]]:
            async with session.post(f"{up.base_url}/chat/completions", json=chat_body(model)) as response:
                return response.status, await response.json(content_type=None)

        results = await asyncio.gather(*(one(i) for i in range(200)))
    statuses = collections.Counter(status for status, _ in results)
    assert statuses == {200: 100, 429: 100}, statuses
    for status, body in results:
        if status == 429:
            assert body["error"]["code"] == "queue_full"  # type: ignore[index]
    assert up.log().count(f"process started name={model}-") == 1
    wait_for(lambda: path_of(up, model) == warm_path(model), 5, "the warm path")


@both_paths("cold-p")
async def test_held_requests_wait_parked_not_in_ext_proc_streams_and_are_served_once(
    cold_gateway: UpProcess, model: str
) -> None:
    """A cold request named in its body waits at extproc's park: Envoy keeps no ext_proc stream
    for it, and its release is followed inside Envoy (the client only sees the model's answer)."""
    up = cold_gateway
    redirects = "cluster.wakegate_extproc.upstream_internal_redirect_succeeded_total"
    before = envoy_stat(up.envoy_admin, redirects)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60)
    ) as session:

        async def one() -> tuple[int, Any]:
            body = chat_body(model)
            async with session.post(f"{up.base_url}/chat/completions", json=body, allow_redirects=False) as response:
                return response.status, await response.json(content_type=None)

        sent = [asyncio.create_task(one()) for _ in range(20)]
        await asyncio.to_thread(wait_for, lambda: model_status(up, model)["queued"] == 20, 10, "20 held")

        def open_streams() -> int:
            stat = "http.wakegate.ext_proc.streams_"
            return envoy_stat(up.envoy_admin, f"{stat}started") - envoy_stat(up.envoy_admin, f"{stat}closed")

        await asyncio.to_thread(wait_for, lambda: open_streams() == 0, 5, "no ext_proc stream open while held")
        assert envoy_stat(up.envoy_admin, "cluster.wakegate_extproc.upstream_rq_active") >= 20
        results = await asyncio.gather(*sent)
    assert [status for status, _ in results] == [200] * 20, results
    assert all(body["choices"][0]["message"]["content"] for _, body in results)
    assert envoy_stat(up.envoy_admin, redirects) - before == 20
    assert up.log().count(f"process started name={model}-") == 1
    # Counted in flight once each (the park's pass is not), and released by their ends.
    wait_for(lambda: model_status(up, model)["in_flight"] == 0, 10, "nothing in flight")


@both_paths("cold-k")
async def test_keepalive_streams_heartbeats_then_tokens(cold_gateway: UpProcess, model: str) -> None:
    up = cold_gateway
    lines: list[str] = []
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{up.base_url}/chat/completions", json=chat_body(model, stream=True, max_tokens=6)) as response,
    ):
        assert response.status == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        async for raw in response.content:
            line = raw.decode().strip()
            if line:
                lines.append(line)
    heartbeats = [i for i, line in enumerate(lines) if line == ": keepalive"]
    data = [i for i, line in enumerate(lines) if line.startswith("data: ")]
    assert len(heartbeats) >= 2, lines
    assert max(heartbeats) < min(data), "heartbeats come before the model's tokens"
    tokens = [json.loads(lines[i][6:]) for i in data if lines[i] != "data: [DONE]"]
    assert sum(1 for t in tokens if t["choices"] and t["choices"][0]["delta"].get("content")) == 6
    assert lines[-1] == "data: [DONE]"
    wait_for(lambda: path_of(up, model) == warm_path(model), 5, "the warm path")


def model_status(up: UpProcess, key: str) -> dict[str, Any]:
    return next(m for m in up.status()["models"] if m["key"] == key)


def attempt_failures(up: UpProcess, key: str) -> float:
    """wakegate_start_attempt_failures_total of `key` on up's /metrics."""
    text = request("GET", f"http://127.0.0.1:{up.admin_port}/metrics").text
    families = text_string_to_metric_families(text)
    found = next((f for f in families if f.name == "wakegate_start_attempt_failures"), None)
    samples = [] if found is None else found.samples
    return sum(s.value for s in samples if s.name.endswith("_total") and s.labels["model"] == key)


@both_paths("cold-crash")
def test_a_held_request_is_served_by_the_retry_after_a_failed_start(
    cold_gateway: UpProcess, faults: Path, model: str
) -> None:
    up = cold_gateway
    before = model_status(up, model)
    metric_before = attempt_failures(up, model)
    (faults / "crash").write_text("crash-once")  # the first start exits while loading, the next is fine
    reply = request("POST", f"{up.base_url}/chat/completions", body=chat_body(model), timeout=30)
    assert reply.status == 200, reply.text
    after = model_status(up, model)
    assert after["failed_start_attempts"] == before["failed_start_attempts"] + 1
    assert "exited with code 3 while loading" in str(after["last_attempt_failure"])
    assert after["failed_activations"] == before["failed_activations"], "the activation itself did not fail"
    assert attempt_failures(up, model) == metric_before + 1
    wait_for(lambda: path_of(up, model) == warm_path(model), 5, "the warm path")
    wait_for(lambda: replicas(up, model) == [], 30, f"{model} to scale to zero (idleTimeout 3)")


@both_paths("cold-crash")
def test_a_start_that_always_fails_fails_held_requests_at_the_deadline_with_the_last_reason(
    cold_gateway: UpProcess, faults: Path, model: str
) -> None:
    (faults / "crash").write_text("crash")  # every start exits while loading
    up, started = cold_gateway, time.monotonic()
    before = model_status(up, model)
    seen: list[dict[str, Any]] = []
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(request, "POST", f"{up.base_url}/chat/completions", body=chat_body(model), timeout=30)
        while not held.done():
            seen += [r["activation"] for r in replicas(up, model) if r.get("activation")]
            time.sleep(0.1)
        failed = held.result()
    waited = time.monotonic() - started
    assert failed.status == 503, failed.text
    error = failed.json()["error"]
    assert error["code"] == "activation_failed"
    assert "exited with code 3 while loading" in error["message"], error
    assert f"attempts in the {CRASH_TIMEOUT}s activationTimeout" in error["message"], error
    # Held until the activation's time was up (less its margin), not failed at the first crash.
    assert CRASH_TIMEOUT - 1.5 <= waited <= CRASH_TIMEOUT + 3, waited
    after = model_status(up, model)
    assert after["failed_start_attempts"] - before["failed_start_attempts"] >= 2
    assert after["failed_activations"] == before["failed_activations"] + 1
    assert max(a["failed_attempts"] for a in seen) >= 1, seen  # /status showed the attempts meanwhile
    time.sleep(1)
    assert replicas(up, model) == [], "no retry once the activation is given up"
    (faults / "crash").unlink()
    ok = request("POST", f"{up.base_url}/chat/completions", body=chat_body(model), timeout=30)
    assert ok.status == 200, ok.text
    wait_for(lambda: path_of(up, model) == warm_path(model), 5, "the warm path")
    wait_for(lambda: replicas(up, model) == [], 30, f"{model} to scale to zero (idleTimeout 3)")


@both_paths("cold-hang")
def test_never_healthy_backend_times_out_then_recovers(cold_gateway: UpProcess, faults: Path, model: str) -> None:
    up = cold_gateway
    (faults / "hang").write_text("hang")
    failed = request("POST", f"{up.base_url}/chat/completions", body=chat_body(model), timeout=30)
    assert failed.status == 503, failed.text
    assert failed.json()["error"]["code"] in ("activation_timeout", "activation_failed")
    # Stopped, and no other activation under way: one that started with the fault in place would
    # hang too and hold the next request (a second wake can follow the first one's failure by a
    # few tens of milliseconds, so "no replicas" is looked for over a second).
    empty_since: list[float] = []

    def settled_empty() -> bool:
        if replicas(up, model):
            empty_since.clear()
            return False
        empty_since[:] = empty_since or [time.monotonic()]
        return time.monotonic() - empty_since[0] >= 1.0

    wait_for(settled_empty, 20, "the hung load to be stopped")
    (faults / "hang").unlink()
    ok = request("POST", f"{up.base_url}/chat/completions", body=chat_body(model), timeout=30)
    assert ok.status == 200, ok.text
    wait_for(lambda: path_of(up, model) == warm_path(model), 5, "the warm path")


def test_cold_start_stages_are_measured(cold_gateway: UpProcess) -> None:
    control = request("GET", f"http://127.0.0.1:{cold_gateway.admin_port}/metrics").text
    for stage in ("process_start", "health_pass", "total"):
        assert f'wakegate_cold_start_seconds_count{{model="cold-a",stage="{stage}"}}' in control
    assert "wakegate_cold_starts_total" in control
    gateway = request("GET", f"http://127.0.0.1:{cold_gateway.admin_port}/metrics/gateway").text
    for stage in ("activation_signal", "first_byte"):
        assert f'wakegate_gateway_cold_start_seconds_count{{model="cold-a",stage="{stage}"}}' in gateway


@both_paths("cold-d")
def test_client_disconnect_frees_its_queue_slot(cold_gateway: UpProcess, model: str) -> None:
    """A client that gives up while held leaves the queue at once; the activation goes on."""
    import socket

    body = json.dumps(chat_body(model)).encode()
    sock = socket.create_connection(("127.0.0.1", cold_gateway.port))
    try:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        wait_for(lambda: model_status(cold_gateway, model)["queued"] == 1, 5, "the request to be held")
    finally:
        sock.close()
    gone = time.monotonic()
    wait_for(lambda: model_status(cold_gateway, model)["queued"] == 0, 5, "the slot to be freed")
    assert time.monotonic() - gone < 1.0
    # The lease outlives the client: the model still comes up.
    wait_for(lambda: model_status(cold_gateway, model)["ready"] == 1, 20, f"{model} to finish loading")
    wait_for(lambda: path_of(cold_gateway, model) == warm_path(model), 5, "the warm path")
