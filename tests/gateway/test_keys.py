"""API keys scoped per model, and where /metrics is served, through the real gateway (Envoy + extproc).

The shared gateway's key file (conftest.KEYS_TEXT) holds a gateway-wide key, one scoped to
chat-a (decided) and one scoped to chat-n (native: Envoy checks its keys itself), so every scope
rule is asserted on both paths. Two small gateways of their own check `--public-metrics open`
and `keys`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.gateway.conftest import API_KEY, KEYS_TEXT, NATIVE, SCOPED_KEY, SCOPED_N_KEY
from tests.support.http import Response, get_json, request
from tests.support.rawhttp import http1
from tests.support.up import UpProcess, model_doc
from tests.support.waiting import wait_for

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
SCOPED = {"authorization": f"Bearer {SCOPED_KEY}"}
SCOPED_N = {"authorization": f"Bearer {SCOPED_N_KEY}"}
WIDE = {"authorization": f"Bearer {API_KEY}"}
CHAT_A_NAMES = {"chat-a", "a", "gpt-a", "org/chat-a", "a-sql"}
CHAT_N_NAMES = {NATIVE, "n", "gpt-n"}


def chat(
    gateway: UpProcess,
    auth: dict[str, str],
    *,
    model: str | None = None,
    path: str = "/v1/chat/completions",
    headers: dict[str, str] | None = None,
) -> Response:
    body = CHAT if model is None else {**CHAT, "model": model}
    return request("POST", f"{gateway.url}{path}", body=body, headers={**auth, **(headers or {})})


def error_of(response: Response) -> dict[str, str]:
    assert response.headers["content-type"].startswith("application/json"), (response.status, response.text)
    error: dict[str, str] = response.json()["error"]
    return error


def ways_to_name(model: str) -> dict[str, dict[str, object]]:
    """Every way a request names a model: body, X-Model-ID header, /model/<name>/ path."""
    return {
        "body": {"model": model},
        "header": {"headers": {"x-model-id": model}},
        "path": {"path": f"/model/{quote(model, safe='')}/v1/chat/completions"},
    }


def leases(gateway: UpProcess, model: str) -> int:
    """Activation leases `model` holds on either extproc (demand a request registered)."""
    total = 0
    for index in (0, 1):
        admin = gateway.child_arg(f"extproc-{index}", "--admin-listen")
        for row in get_json(f"http://{admin}/wakegate/queue")["models"]:
            if row["model"] == model:
                total += row["leases"]
    return total


#: (key's auth header, its model, a name of that model): the decided and the native scope
SCOPED_NAMES = [(SCOPED, "chat-a", name) for name in sorted(CHAT_A_NAMES - {"a-sql"})] + [
    (SCOPED_N, NATIVE, name) for name in sorted(CHAT_N_NAMES)
]


@pytest.mark.parametrize(("auth", "model", "name"), SCOPED_NAMES)
@pytest.mark.parametrize("way", ["body", "header", "path"])
def test_scoped_key_reaches_its_model_by_any_name(
    gateway: UpProcess, way: str, auth: dict[str, str], model: str, name: str
) -> None:
    response = chat(gateway, auth, **ways_to_name(name)[way])  # type: ignore[arg-type]
    assert response.status == 200, response.text
    assert response.headers["x-wakegate-upstream"] in set(gateway.endpoints(model))


#: (key's auth header, a name outside its scope): a model by its name, by its alias, another one
OUTSIDE = [(SCOPED, name) for name in ("chat-b", "b", "chat-p", NATIVE, "n")] + [
    (SCOPED_N, name) for name in ("chat-a", "a", "chat-b")
]


@pytest.mark.parametrize(("auth", "name"), OUTSIDE)
@pytest.mark.parametrize("way", ["body", "header", "path"])
def test_scoped_key_cannot_reach_another_model(gateway: UpProcess, way: str, auth: dict[str, str], name: str) -> None:
    refused = chat(gateway, auth, **ways_to_name(name)[way])  # type: ignore[arg-type]
    unknown = chat(gateway, auth, **ways_to_name("no-such-model")[way])  # type: ignore[arg-type]
    assert refused.status == unknown.status == 404, refused.text
    assert "x-wakegate-upstream" not in refused.headers
    # Indistinguishable from a model that does not exist.
    assert error_of(refused)["code"] == error_of(unknown)["code"] == "model_not_found"
    assert error_of(refused)["message"].replace(f"'{name}'", "'no-such-model'") == error_of(unknown)["message"]
    # The gateway-wide key still reaches it the same way.
    allowed = chat(gateway, WIDE, **ways_to_name(name)[way])  # type: ignore[arg-type]
    assert allowed.status == 200, allowed.text


def test_scoped_key_does_not_wake_a_model_outside_its_scope(gateway: UpProcess) -> None:
    refused = chat(gateway, SCOPED, model="chat-z")
    assert refused.status == 404 and error_of(refused)["code"] == "model_not_found"
    assert leases(gateway, "chat-z") == 0  # no demand was registered
    assert [m["replicas"] for m in gateway.status()["models"] if m["key"] == "chat-z"] == [[]]
    woken = chat(gateway, WIDE, model="chat-z")  # the same request with a key for every model wakes it
    assert woken.status == 503 and error_of(woken)["code"] == "model_not_ready"
    assert leases(gateway, "chat-z") == 1


def listed(gateway: UpProcess, auth: dict[str, str]) -> set[str]:
    response = request("GET", f"{gateway.url}/v1/models", headers=auth)
    assert response.status == 200, response.text
    return {m["id"] for m in response.json()["data"]}


def test_models_list_shows_only_the_keys_models(gateway: UpProcess) -> None:
    assert listed(gateway, SCOPED) == CHAT_A_NAMES
    assert listed(gateway, SCOPED_N) == CHAT_N_NAMES
    assert CHAT_A_NAMES | CHAT_N_NAMES | {"chat-b", "b", "chat-p", "chat-z"} <= listed(gateway, WIDE)
    assert request("GET", f"{gateway.url}/v1/models/gpt-a", headers=SCOPED).status == 200
    hidden = request("GET", f"{gateway.url}/v1/models/b", headers=SCOPED)
    assert hidden.status == 404 and error_of(hidden)["code"] == "model_not_found"


@pytest.mark.parametrize(("model", "alias"), [("chat-b", "b"), (NATIVE, "n")])  # decided, native
def test_scoped_key_file_rotation_without_restart(gateway: UpProcess, keys_file: Path, model: str, alias: str) -> None:
    def answers(status: int) -> bool:
        return all(chat(gateway, SCOPED, **way).status == status for way in ways_to_name(alias).values())  # type: ignore[arg-type]

    keys_file.write_text(f"# test keys\n{API_KEY}\n{SCOPED_KEY}  chat-a, {model}\n")
    try:
        wait_for(lambda: answers(200), 5.0, "the widened scope by body, header and path")
        assert model in listed(gateway, SCOPED)
    finally:
        keys_file.write_text(KEYS_TEXT)
    wait_for(lambda: answers(404), 5.0, "the narrowed scope by body, header and path")
    assert listed(gateway, SCOPED) == CHAT_A_NAMES


def test_bad_key_file_lines_are_reported_by_number_without_the_key(gateway: UpProcess, keys_file: Path) -> None:
    bad_key = "sk-test-badline-5555555555"
    logs = [gateway.state_dir / "logs" / f"extproc-{i}.log" for i in (0, 1)]
    keys_file.write_text(f"# test keys\n{API_KEY}\n{SCOPED_KEY}  chat-a\n{bad_key}  chat-b,,chat-p\n")
    try:

        def reported() -> bool:
            chat(gateway, WIDE, model="chat-a")  # keys are re-read when a request is checked
            return any("line 4" in log.read_text(errors="replace") for log in logs)

        wait_for(reported, 5.0, "a warning naming line 4")
        assert chat(gateway, {"authorization": f"Bearer {bad_key}"}, model="chat-b").status == 401
        assert chat(gateway, SCOPED, model="chat-a").status == 200  # the good lines stay in force
    finally:
        keys_file.write_text(KEYS_TEXT)
    for log in logs:
        assert bad_key not in log.read_text(errors="replace")


# -- /metrics on the public listener ----------------------------------------------------------------


def test_metrics_not_on_the_public_listener_by_default(gateway: UpProcess) -> None:
    for auth in ({}, WIDE):
        response = request("GET", f"{gateway.url}/metrics", headers=auth)
        assert response.status == 404 and error_of(response)["code"] == "not_found"
    assert request("GET", f"{gateway.url}/healthz").status == 200
    # The gateway's metrics are on the admin port.
    scraped = request("GET", f"http://127.0.0.1:{gateway.admin_port}/metrics/gateway")
    assert scraped.status == 200 and b"wakegate_gateway_requests_total" in scraped.body


@pytest.fixture(scope="module", params=["open", "keys"])
def metrics_gateway(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    tmp = tmp_path_factory.mktemp(f"metrics-{request.param}")
    keys = tmp / "keys.txt"
    keys.write_text(f"{API_KEY}\n{SCOPED_KEY} chat-x\n")
    fleet = model_doc("chat-x", extra="  scaling: {min: 0, max: 1}\n")
    up = UpProcess(tmp, fleet, "--api-keys-file", str(keys), "--public-metrics", request.param)
    try:
        up.wait_ready()
        yield up
    finally:
        assert up.stop() == 0, up.log()


def test_public_metrics_open_or_behind_keys(metrics_gateway: UpProcess) -> None:
    mode = metrics_gateway.child_arg("extproc-0", "--public-metrics")
    anonymous = http1(metrics_gateway.port, b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
    if mode == "open":
        assert anonymous.status == 200
        assert anonymous.headers["content-type"].startswith("text/plain")  # Prometheus text passes unchanged
        assert b"wakegate_gateway_requests_total" in anonymous.body
        return
    assert mode == "keys"
    assert anonymous.status == 401 and anonymous.error()["code"] == "invalid_api_key"
    wrong = request("GET", f"{metrics_gateway.url}/metrics", headers={"authorization": "Bearer sk-wrong"})
    assert wrong.status == 401
    for auth in (WIDE, SCOPED):  # any valid key, scoped or not
        scraped = http1(
            metrics_gateway.port,
            b"GET /metrics HTTP/1.1\r\nhost: x\r\nauthorization: " + auth["authorization"].encode() + b"\r\n\r\n",
        )
        assert scraped.status == 200 and scraped.headers["content-type"].startswith("text/plain")
        assert b"wakegate_gateway_requests_total" in scraped.body
