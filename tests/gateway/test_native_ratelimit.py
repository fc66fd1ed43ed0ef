"""Per-model rate limits on the native path: one bucket per model, in Envoy, whatever path each
request takes (docs/decisions.md, "The native path").

Twin models again, `rl-n` (native) and `rl-d` (decided), with the same limit: a burst gets the same
answers from both. `rl-m` mixes native requests (its own name) with decided ones (its alias in the
body, rewritten by extproc): they share one budget. `rl-c` is a cold native model: its requests
take the decided path (extproc holds them) yet draw from the same bucket in Envoy, and one over the
limit is refused at once, never after waiting for the cold start. `rl-hn` (native) and `rl-hd`
(decided) are cold models whose bucket refills nothing within their start: the requests it admitted
and a park held are not counted again when they are sent back. `rl-f` is named where Envoy cannot
read the name (a multipart form): extproc still counts those.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.test_native import Gateway
from tests.support.http import request
from tests.support.up import UpProcess, model_doc
from wakegate.control.admin import free_port

RATE = 0.5
BURST = 3
#: A bucket that refills no token within a cold start.
SLOW = 0.02
LIMIT = f"  limits: {{requestsPerSecond: {RATE}, burst: {BURST}}}\n"
FLEET = "".join(
    model_doc(
        name,
        extra=f"""  aliases: [{name}-alias]
  routing: {{strategy: round-robin{", path: native" if name != "rl-d" else ""}}}
  scaling: {{min: 1, max: 1}}
{LIMIT}""",
    )
    for name in ("rl-n", "rl-d", "rl-m", "rl-f")
) + model_doc(
    "rl-c",
    extra=f"""  args: [--startup-seconds, "3"]
  routing: {{strategy: round-robin, path: native}}
  scaling: {{min: 0, max: 1, idleTimeout: 60}}
  limits: {{requestsPerSecond: {RATE}, burst: 1}}
""",
) + "".join(
    model_doc(
        name,
        extra=f"""  args: [--startup-seconds, "2"]
  routing: {{strategy: round-robin{", path: native" if name == "rl-hn" else ""}}}
  scaling: {{min: 0, max: 1, idleTimeout: 60}}
  limits: {{requestsPerSecond: {SLOW}, burst: {BURST}}}
""",
    )
    for name in ("rl-hn", "rl-hd")
)
REFUSED = {"error": {"message": "rate limit exceeded; retry later", "type": "rate_limit_error", "code": "rate_limited"}}


@pytest.fixture(scope="module")
def limited_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp: Path = tmp_path_factory.mktemp("native-rl")
    envoy_admin = f"127.0.0.1:{free_port()}"
    up = UpProcess(tmp, FLEET, "--envoy-admin-listen", envoy_admin)
    try:
        up.wait_ready({"rl-n": 1, "rl-d": 1, "rl-m": 1, "rl-f": 1}, timeout=90)
        gw = Gateway(up, envoy_admin)
        deadline = time.monotonic() + 10
        while {gw.model(m)["routingPath"] for m in ("rl-n", "rl-m")} != {"native"} and time.monotonic() < deadline:
            time.sleep(0.1)
        yield gw
    finally:
        code = up.stop()
        assert code == 0, up.log()


def chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


def post(gw: Gateway, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    hdrs = {"content-type": "application/json", **(headers or {})}
    return request("POST", gw.up.url + "/v1/chat/completions", headers=hdrs, body=body)


def burst(calls: list[Callable[[], Any]]) -> tuple[list[Any], float]:
    """All `calls` at once: the replies in order, and the seconds from the first send to the last answer."""
    started = time.monotonic()
    with ThreadPoolExecutor(len(calls)) as pool:
        replies = list(pool.map(lambda call: call(), calls))
    return replies, time.monotonic() - started


def most_admitted(seconds: float, burst: int = BURST) -> int:
    """A full bucket of `burst` plus what it refills in `seconds`, at most."""
    return burst + math.floor(RATE * seconds)


def assert_refused_alike(reply: Any) -> None:
    assert reply.status == 429, reply.text
    assert reply.json() == REFUSED
    assert reply.headers["content-type"] == "application/json"
    # Envoy answers ceil(1 / rate); extproc the exact wait, which is no longer.
    assert 1 <= int(reply.headers["retry-after"]) <= math.ceil(1 / RATE)


def test_a_rate_limited_model_asking_for_native_goes_native(limited_gateway: Gateway) -> None:
    assert limited_gateway.model("rl-n")["routingPath"] == "native"
    assert limited_gateway.model("rl-d")["routingPath"] == "decided"


@pytest.mark.parametrize("model", ["rl-n", "rl-d"])
def test_a_burst_gets_the_burst_and_identical_429s_on_both_paths(limited_gateway: Gateway, model: str) -> None:
    gw = limited_gateway
    before = gw.extproc_streams()
    replies, seconds = burst([lambda: post(gw, chat(model)) for _ in range(BURST + 4)])
    opened = gw.extproc_streams() - before
    admitted = [r for r in replies if r.status == 200]
    # One bucket per gateway, Envoy's, for the decided twin too: never twice the burst.
    assert BURST <= len(admitted) <= most_admitted(seconds), [r.status for r in replies]
    for reply in replies:
        if reply.status != 200:
            assert_refused_alike(reply)
    if model == "rl-n":
        assert opened == 0, "a native request (admitted or refused) opened an ext_proc stream"
    else:
        # Envoy refuses before ext_proc: only the admitted requests reach an extproc.
        assert opened == len(admitted)


def test_native_and_decided_requests_of_one_model_share_one_budget(limited_gateway: Gateway) -> None:
    gw = limited_gateway
    kinds = {
        "native by body": lambda: post(gw, chat("rl-m")),
        "native by header": lambda: post(gw, chat("rl-m"), {"x-model-id": "rl-m"}),
        "alias in the body (decided)": lambda: post(gw, chat("rl-m-alias")),
    }
    order = list(kinds) * 3
    before = gw.extproc_streams()
    started = time.monotonic()
    replies = [kinds[kind]() for kind in order]
    seconds = time.monotonic() - started
    opened = gw.extproc_streams() - before
    admitted = [kind for kind, reply in zip(order, replies, strict=True) if reply.status == 200]
    # One budget: the burst, not a burst per path.
    assert BURST <= len(admitted) <= most_admitted(seconds), list(zip(order, [r.status for r in replies], strict=True))
    assert set(admitted[:BURST]) == set(kinds), admitted
    for reply in replies:
        if reply.status != 200:
            assert_refused_alike(reply)
    # Only the alias went through extproc, and only while admitted: a refusal is Envoy's own.
    decided = [reply for kind, reply in zip(order, replies, strict=True) if kind.startswith("alias")]
    assert opened == sum(1 for reply in decided if reply.status == 200)


def test_a_request_envoy_cannot_name_is_still_limited_by_extproc(limited_gateway: Gateway) -> None:
    gw = limited_gateway
    form = b'--b0\r\nContent-Disposition: form-data; name="model"\r\n\r\nrl-f\r\n--b0--\r\n'
    headers = {"content-type": "multipart/form-data; boundary=b0"}
    started = time.monotonic()
    replies = [
        request("POST", gw.up.url + "/v1/audio/transcriptions", headers=headers, body=form)
        for _ in range(BURST * 2 + 2)
    ]
    # Routed to the sim (which has no audio endpoint: its 404 proves the hop) up to the burst, then
    # refused (up to twice the burst right after start, one bucket per extproc: docs/reliability.md).
    passed = [r for r in replies if r.status != 429]
    assert {r.status for r in passed} == {404}
    assert BURST <= len(passed) <= most_admitted(time.monotonic() - started) + BURST
    assert_refused_alike(replies[-1])


def test_a_cold_native_model_refuses_over_its_limit_at_once_and_holds_the_rest(limited_gateway: Gateway) -> None:
    """burst 1: the first request is held while the model wakes (3 s); the second, sent meanwhile,
    is refused without waiting for the cold start."""
    gw = limited_gateway
    assert gw.model("rl-c")["ready"] == 0
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(post, gw, chat("rl-c"))
        deadline = time.monotonic() + 5
        while gw.model("rl-c")["queued"] == 0:
            assert time.monotonic() < deadline, "the first request was not held"
            time.sleep(0.05)
        refused = post(gw, chat("rl-c"), {"x-model-id": "rl-c"})
        assert not held.done(), "the refusal came only after the cold start"
        first = held.result()
    assert first.status == 200, first.text
    assert_refused_alike(refused)
    assert refused.headers["retry-after"] == "2"
    assert json.loads(first.text)["model"] == "rl-c"


def test_a_gateway_wide_limit_keeps_every_model_decided_and_still_counts_every_request(tmp_path: Path) -> None:
    """`--global-rps`: extproc's one bucket for all models must see every request, so no model
    goes native, and /status says why."""
    fleet = model_doc("g-n", extra="  routing: {strategy: round-robin, path: native}\n")
    up = UpProcess(tmp_path, fleet, "--global-rps", "0.5", "--global-burst", "2")
    try:
        up.wait_ready({"g-n": 1}, timeout=60)
        (status,) = up.status()["models"]
        assert status["routingPath"] == "decided"
        assert status["routingPathReason"] == "a gateway-wide rate limit (--global-rps)"
        url = up.url + "/v1/chat/completions"
        started = time.monotonic()
        codes = [
            request("POST", url, headers={"content-type": "application/json"}, body=chat("g-n")).status
            for _ in range(8)
        ]
        refilled = math.floor(0.5 * (time.monotonic() - started))
        # The model has no limit of its own: only extproc's gateway-wide bucket (burst 2) refuses,
        # so a 429 proves the requests met extproc (up to twice the burst right after start, one
        # bucket per extproc: docs/reliability.md).
        assert codes[:2] == [200, 200] and 2 <= codes.count(200) <= 4 + refilled and 429 in codes, codes
    finally:
        assert up.stop() == 0, up.log()


@pytest.mark.parametrize("model", ["rl-hn", "rl-hd"])
def test_requests_held_through_a_cold_start_are_counted_once(limited_gateway: Gateway, model: str) -> None:
    """A full burst sent to a cold model: every request takes its token, waits in a park for the
    start, and is answered once the model is ready; none is refused by a second count on the way
    back (the bucket refills nothing meanwhile). The next one is refused: the burst is spent."""
    gw = limited_gateway
    assert gw.model(model)["ready"] == 0
    replies, _ = burst([lambda: post(gw, chat(model)) for _ in range(BURST)])
    assert [r.status for r in replies] == [200] * BURST, [r.text for r in replies]
    assert {json.loads(r.text)["model"] for r in replies} == {model}
    spent = post(gw, chat(model))
    assert spent.status == 429 and spent.json() == REFUSED, spent.text
