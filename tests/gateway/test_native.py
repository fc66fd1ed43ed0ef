"""The native path (routing.path native) through the real gateway, side by side with the decided path.

Two twin models, `nat` (native) and `dec` (decided), both round-robin over two sim replicas:
every behaviour a client sees is asserted the same for both, and Envoy's own counters tell
which path a request took (a natively routed request opens no ext_proc stream). Then the
transitions of a scale-to-zero model under load: cold (decided, held) -> warm (native) ->
idle release on time -> cold again, with no 5xx and no request lost.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.http import EXTPROC_STREAMS, envoy_stat, request
from tests.support.up import UpProcess, model_doc
from wakegate.control.admin import free_port

TWINS = "".join(
    model_doc(
        name,
        extra=f"""  aliases: [{name}-alias]
  args: [--tokens-per-second, "20"]
  routing: {{strategy: round-robin{", path: native" if name == "nat" else ""}}}
  scaling: {{min: 2, max: 2}}
""",
    )
    for name in ("nat", "dec")
)
IDLE_SECONDS = 3
WAKERS = "".join(
    model_doc(
        name,
        extra=f"""  args: [--startup-seconds, "1"]
  routing: {{strategy: round-robin{", path: native" if name == "wake-n" else ""}}}
  scaling: {{min: 0, max: 1, idleTimeout: {IDLE_SECONDS}}}
""",
    )
    for name in ("wake-n", "wake-d")
)


class Gateway:
    def __init__(self, up: UpProcess, envoy_admin: str) -> None:
        self.up = up
        self.envoy_admin = envoy_admin

    def stat(self, name: str) -> int:
        return envoy_stat(self.envoy_admin, name)

    def extproc_streams(self) -> int:
        return self.stat(EXTPROC_STREAMS)

    def model(self, key: str) -> dict[str, Any]:
        return next(m for m in self.up.status()["models"] if m["key"] == key)


@pytest.fixture(scope="module")
def native_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp: Path = tmp_path_factory.mktemp("native")
    envoy_admin = f"127.0.0.1:{free_port()}"
    up = UpProcess(tmp, TWINS + WAKERS, "--envoy-admin-listen", envoy_admin)
    try:
        up.wait_ready({"nat": 2, "dec": 2}, timeout=90)
        gw = Gateway(up, envoy_admin)
        deadline = time.monotonic() + 10
        while gw.model("nat")["routingPath"] != "native" and time.monotonic() < deadline:
            time.sleep(0.1)
        yield gw
    finally:
        code = up.stop()
        assert code == 0, up.log()


def chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, **extra}


def post(gw: Gateway, path: str, body: dict[str, Any] | bytes, headers: dict[str, str] | None = None) -> Any:
    hdrs = {"content-type": "application/json", **(headers or {})}
    return request("POST", gw.up.url + path, headers=hdrs, body=body)


def test_status_names_each_models_path(native_gateway: Gateway) -> None:
    assert native_gateway.model("nat")["routingPath"] == "native"
    dec = native_gateway.model("dec")
    assert dec["routingPath"] == "decided" and dec["routingPathReason"] == "routing.path is decided"
    cold = native_gateway.model("wake-n")
    assert cold["routingPath"] == "decided" and cold["routingPathReason"] == "no ready endpoint"


NAMINGS = {
    "body": lambda m: ("/v1/chat/completions", chat(m), {}),
    "header": lambda m: ("/v1/chat/completions", chat(m), {"x-model-id": m}),
    "path": lambda m: (f"/model/{m}/v1/chat/completions", chat(m), {}),
}


@pytest.mark.parametrize("naming", sorted(NAMINGS))
@pytest.mark.parametrize("model", ["nat", "dec"])
def test_named_any_way_both_paths_answer_alike_round_robin(native_gateway: Gateway, model: str, naming: str) -> None:
    gw = native_gateway
    path, body, headers = NAMINGS[naming](model)
    before = gw.extproc_streams()
    replies = [post(gw, path, body, headers) for _ in range(4)]
    opened = gw.extproc_streams() - before
    for reply in replies:
        assert reply.status == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"]
    if naming == "body":
        assert {r.json()["model"] for r in replies} == {model}
    # Round robin: both replicas answer, alternately.
    assert len({r.headers["x-wakegate-upstream"] for r in replies}) == 2
    if model == "nat":
        assert opened == 0, "a native request opened an ext_proc stream"
    else:
        assert opened >= 4


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON"])
def test_a_json_body_is_read_natively_whatever_its_media_type_says(native_gateway: Gateway, content_type: str) -> None:
    """Many clients send `application/json; charset=utf-8`: Envoy reads the body's `model` from
    those too, so the request stays on the native path (no extproc stream)."""
    gw = native_gateway
    before = gw.extproc_streams()
    reply = post(gw, "/v1/chat/completions", chat("nat"), {"content-type": content_type})
    assert reply.status == 200, reply.text
    assert gw.extproc_streams() == before


@pytest.mark.parametrize("model", ["nat", "dec"])
def test_streaming_answers_alike(native_gateway: Gateway, model: str) -> None:
    reply = post(native_gateway, "/v1/chat/completions", chat(model, stream=True, max_tokens=4))
    assert reply.status == 200
    events = [line for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert sum(1 for e in events[:-1] if json.loads(e[6:])["choices"][0]["delta"].get("content")) == 4


@pytest.mark.parametrize("model", ["nat", "dec"])
def test_an_alias_in_the_body_is_rewritten_on_both(native_gateway: Gateway, model: str) -> None:
    # The alias needs extproc's rewrite of `model`: the native model takes the decided path for it.
    reply = post(native_gateway, "/v1/chat/completions", chat(f"{model}-alias"))
    assert reply.status == 200, reply.text
    assert reply.json()["model"] == model


@pytest.mark.parametrize("model", ["nat", "dec"])
def test_bad_input_gets_the_same_answer_on_both(native_gateway: Gateway, model: str) -> None:
    gw = native_gateway
    broken = post(gw, "/v1/chat/completions", b'{"model": "' + model.encode() + b'", "messages": [')
    assert broken.status == 400 and broken.json()["error"]["code"] == "invalid_json"
    numeric = post(gw, "/v1/chat/completions", {"model": 7, "messages": []})
    assert numeric.status == 400
    listed = request("GET", gw.up.url + "/v1/models", headers={"x-model-id": model})
    assert listed.status == 200 and {"nat", "dec"} <= {m["id"] for m in listed.json()["data"]}
    missing = post(gw, "/v1/chat/completions", chat(model + "-nope"))
    assert missing.status == 404 and missing.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("model", ["nat", "dec"])
def test_a_client_cannot_pick_the_backend_or_hide_from_accounting(native_gateway: Gateway, model: str) -> None:
    gw = native_gateway
    target = gw.up.endpoints(model)[0]
    headers = {"x-gateway-destination-endpoint": target, "x-wakegate-native": "1"}
    replies = [post(gw, "/v1/chat/completions", chat(model), headers) for _ in range(4)]
    assert all(r.status == 200 for r in replies)
    assert len({r.headers["x-wakegate-upstream"] for r in replies}) == 2, "the client picked the backend"
    # A decided request that claimed to be native still ended in extproc's books.
    deadline = time.monotonic() + 5
    while gw.model(model)["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gw.model(model)["in_flight"] == 0


@pytest.mark.parametrize("model", ["nat", "dec"])
def test_demand_counts_a_request_in_flight_on_both_paths(native_gateway: Gateway, model: str) -> None:
    """A 2 s generation (20 tokens/s) is in flight in the demand book while it runs, native or not."""
    gw = native_gateway

    async def run() -> list[int]:
        seen: list[int] = []
        async with aiohttp.ClientSession() as session:
            call = asyncio.ensure_future(
                session.post(gw.up.url + "/v1/chat/completions", json=chat(model, max_tokens=40))
            )
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                seen.append(await asyncio.to_thread(lambda: gw.model(model)["in_flight"]))
            response = await call
            assert response.status == 200
            await response.read()
        return seen

    seen = asyncio.run(run())
    assert max(seen) == 1, seen


async def _load(url: str, model: str, until: asyncio.Event, workers: int = 12) -> tuple[int, dict[int, int], float]:
    """Requests from `workers` clients until `until` is set: (sent, statuses, seconds)."""
    statuses: dict[int, int] = {}
    sent = 0
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def worker() -> None:
            nonlocal sent
            while not until.is_set():
                sent += 1
                try:
                    async with session.post(url + "/v1/chat/completions", json=chat(model)) as response:
                        await response.read()
                        statuses[response.status] = statuses.get(response.status, 0) + 1
                except aiohttp.ClientError:
                    statuses[0] = statuses.get(0, 0) + 1

        await asyncio.gather(*(worker() for _ in range(workers)))
    return sent, statuses, time.monotonic() - started


@pytest.mark.parametrize("model", ["wake-n", "wake-d"])
def test_cold_to_warm_to_idle_under_load_loses_nothing_and_releases_on_time(
    native_gateway: Gateway, model: str
) -> None:
    """Load on a cold model: held while it wakes, native once warm (wake-n), and kept warm by
    that load for longer than idleTimeout; released idleTimeout after the last request, then
    woken again by the next one. No 5xx, no request lost, on either path."""
    gw = native_gateway
    assert gw.model(model)["ready"] == 0

    async def scenario() -> dict[str, Any]:
        stop = asyncio.Event()
        load = asyncio.ensure_future(_load(gw.up.url, model, stop))
        # Wait for the model to wake (the first requests are held meanwhile)...
        deadline = time.monotonic() + 30
        while (await asyncio.to_thread(gw.model, model))["ready"] == 0:
            assert time.monotonic() < deadline, "the model did not wake"
            await asyncio.sleep(0.1)
        path = (await asyncio.to_thread(gw.model, model))["routingPath"]
        streams = await asyncio.to_thread(gw.extproc_streams)
        # ...then keep it busy for longer than idleTimeout: it must stay up all along.
        busy_until = time.monotonic() + IDLE_SECONDS + 2
        replicas_seen = set()
        while time.monotonic() < busy_until:
            replicas_seen.add((await asyncio.to_thread(gw.model, model))["ready"])
            await asyncio.sleep(0.2)
        streams = await asyncio.to_thread(gw.extproc_streams) - streams
        stop.set()
        sent, statuses, seconds = await load
        last = time.monotonic()
        while (await asyncio.to_thread(gw.model, model))["ready"] > 0:
            assert time.monotonic() - last < IDLE_SECONDS + 10, "not released"
            await asyncio.sleep(0.05)
        released = time.monotonic() - last
        after = await asyncio.to_thread(gw.model, model)
        return {
            "path": path,
            "streams": streams,
            "replicas_seen": replicas_seen,
            "sent": sent,
            "statuses": statuses,
            "seconds": seconds,
            "released": released,
            "after": after,
        }

    result = asyncio.run(scenario())
    print(f"{model}: {result['sent']} requests in {result['seconds']:.1f}s, released {result['released']:.2f}s after")
    assert result["statuses"] == {200: result["sent"]}, result["statuses"]
    assert result["replicas_seen"] == {1}, "released while busy"
    assert result["path"] == ("native" if model == "wake-n" else "decided")
    if model == "wake-n":
        assert result["streams"] < 20, "warm requests still went through extproc"
    # idleTimeout holds to within a second (plus one status poll).
    assert IDLE_SECONDS - 0.5 <= result["released"] <= IDLE_SECONDS + 1.2, result["released"]
    assert result["after"]["routingPath"] == "decided"
    # Cold again: the next request is held and wakes it.
    again = post(gw, "/v1/chat/completions", chat(model))
    assert again.status == 200, again.text


def test_with_api_keys_and_a_rate_limit_models_go_native_and_a_refused_key_spends_no_token(tmp_path: Path) -> None:
    """Envoy's native routes check the gateway's keys (tests/gateway/test_native_keys.py) and keep
    the model's bucket (tests/gateway/test_native_ratelimit.py): with both, both models are
    native, a request refused for its key takes no token, and the bucket refuses past the burst."""
    key = "sk-native-test-0123456789"
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{key}\n")
    fleet = model_doc(
        "nk", extra="  routing: {strategy: round-robin, path: native}\n  scaling: {min: 1, max: 1}\n"
    ) + model_doc(
        "nr",
        extra="  routing: {strategy: round-robin, path: native}\n  limits: {requestsPerSecond: 0.5, burst: 2}\n"
        "  scaling: {min: 1, max: 1}\n",
    )
    (tmp_path / "keyed").mkdir()
    keyed = UpProcess(tmp_path / "keyed", fleet, "--api-keys-file", str(keys))
    try:
        keyed.wait_ready({"nk": 1, "nr": 1}, timeout=60)
        deadline = time.monotonic() + 10
        while keyed.status()["models"][0]["routingPath"] != "native" and time.monotonic() < deadline:
            time.sleep(0.1)
        status = {m["key"]: m for m in keyed.status()["models"]}
        assert status["nk"]["routingPath"] == "native"
        assert status["nr"]["routingPath"] == "native"
        url = keyed.url + "/v1/chat/completions"
        # Refused for the key, on either path's naming: no token of nr's bucket is spent...
        for naming in ({}, {"x-model-id": "nr"}, {}, {"x-model-id": "nr"}):
            refused = request("POST", url, headers={"content-type": "application/json", **naming}, body=chat("nr"))
            assert refused.status == 401, refused.text
        # ...so the burst of 2 is still whole.
        started = time.monotonic()
        codes = [
            request(
                "POST",
                url,
                headers={"content-type": "application/json", "authorization": f"Bearer {key}", **naming},
                body=chat("nr"),
            ).status
            for naming in ({}, {"x-model-id": "nr"}) * 2
        ]
        refilled = int(0.5 * (time.monotonic() - started))
        assert codes[:2] == [200, 200] and 2 <= codes.count(200) <= 2 + refilled and 429 in codes[2:], codes
        for naming in ({}, {"x-model-id": "nk"}):
            refused = request("POST", url, headers={"content-type": "application/json", **naming}, body=chat("nk"))
            assert refused.status == 401 and refused.json()["error"]["code"] == "invalid_api_key"
            ok = request(
                "POST",
                url,
                headers={"content-type": "application/json", "authorization": f"Bearer {key}", **naming},
                body=chat("nk"),
            )
            assert ok.status == 200, ok.text
            assert "authorization" not in ok.text
    finally:
        assert keyed.stop() == 0, keyed.log()
    # No keys: the rate-limited model is native too, and its one bucket (Envoy's) refuses past the burst.
    (tmp_path / "open").mkdir()
    opened = UpProcess(tmp_path / "open", fleet)
    try:
        opened.wait_ready({"nk": 1, "nr": 1}, timeout=60)
        deadline = time.monotonic() + 10
        while {m["routingPath"] for m in opened.status()["models"]} != {"native"} and time.monotonic() < deadline:
            time.sleep(0.1)
        status = {m["key"]: m for m in opened.status()["models"]}
        assert status["nk"]["routingPath"] == "native"
        assert status["nr"]["routingPath"] == "native"
        url = opened.url + "/v1/chat/completions"
        started = time.monotonic()
        codes = [
            request("POST", url, headers={"content-type": "application/json", **naming}, body=chat("nr")).status
            for naming in ({}, {"x-model-id": "nr"}) * 3
        ]
        # burst 2, plus what 0.5/s refills meanwhile; one bucket per gateway, not one per extproc.
        refilled = int(0.5 * (time.monotonic() - started))
        assert codes[:2] == [200, 200] and 2 <= codes.count(200) <= 2 + refilled and 429 in codes[2:], codes
    finally:
        assert opened.stop() == 0, opened.log()
