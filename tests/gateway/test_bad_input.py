"""Bad input through the real gateway: each gets its OpenAI-shaped error; nothing crashes.

Requests that name the native model (`n`, routed by Envoy alone when its body is well-formed)
get the same answers as the decided ones."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.gateway.conftest import API_KEY, KEYS_TEXT, MAX_BODY, NATIVE
from tests.support.http import Response, request
from tests.support.up import UpProcess

AUTH = {"authorization": f"Bearer {API_KEY}"}
GOOD = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
GOOD_N = {**GOOD, "model": "n"}  # the native model, by its alias


def post(
    gateway: UpProcess,
    body: bytes | dict[str, object] | None,
    headers: dict[str, str] | None = None,
    path: str = "/v1/chat/completions",
):
    return request("POST", f"{gateway.url}{path}", body=body, headers={**AUTH, **(headers or {})})


def assert_error(response, status: int, code: str) -> None:
    assert response.status == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == code, error
    assert error["message"] and error["type"]


@pytest.mark.parametrize(
    ("body", "content_type", "status", "code"),
    [
        (b"{not json", "application/json", 400, "invalid_json"),
        (b"[1, 2]", "application/json", 400, "invalid_json"),
        (b'{"messages": []}', "application/json", 400, "model_required"),
        (b'{"model": 7}', "application/json", 400, "model_required"),
        (b'{"model": ""}', "application/json", 400, "model_required"),
        (b"\xff\xfe\x00garbage", "application/json", 400, "invalid_json"),
        (b"model=a", "application/x-www-form-urlencoded", 415, "unsupported_media_type"),
        (b"hello", "text/plain", 415, "unsupported_media_type"),
        (b'{"model": "no-such-model"}', "application/json", 404, "model_not_found"),
        # The native model's name in a body Envoy must not route alone: extproc answers.
        (b'{"model": "n"', "application/json", 400, "invalid_json"),
        (b'{"model": "n"}', "text/plain", 415, "unsupported_media_type"),
        (b"model=n", "application/x-www-form-urlencoded", 415, "unsupported_media_type"),
    ],
)
def test_malformed_bodies(gateway: UpProcess, body: bytes, content_type: str, status: int, code: str) -> None:
    assert_error(post(gateway, body, {"content-type": content_type}), status, code)


def test_empty_body(gateway: UpProcess) -> None:
    assert_error(post(gateway, b"", {"content-type": "application/json"}), 400, "model_required")


@pytest.mark.parametrize("model", ["a", "n"])
def test_huge_body_is_refused_by_content_length(gateway: UpProcess, model: str) -> None:
    big = b'{"model": "' + model.encode() + b'", "pad": "' + b"x" * (MAX_BODY + 10) + b'"}'
    assert_error(post(gateway, big, {"content-type": "application/json"}), 413, "body_too_large")


def _oversized_chunked(port: int) -> tuple[str, bytes]:
    """One oversized chunked upload: its status and body, or how the connection ended."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    chunks = [b'{"model": "a", "pad": "', *([b"y" * 16384] * 8), b'"}']
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=iter(chunks),
            encode_chunked=True,
            headers={**AUTH, "content-type": "application/json", "transfer-encoding": "chunked"},
        )
        response = conn.getresponse()
        return str(response.status), response.read()
    except (ConnectionResetError, BrokenPipeError):
        # Envoy answers 413 as soon as the buffer limit is passed and closes the connection; when
        # unread body bytes are still queued, the kernel may turn that close into a reset that
        # drops the answer. Such a reset is a network fact, not a gateway failure.
        return "reset", b""
    except TimeoutError:
        return "no answer", b""
    finally:
        conn.close()


def test_huge_chunked_body_is_refused(gateway: UpProcess) -> None:
    for _ in range(3):  # a reset (see _oversized_chunked) is tried again
        outcome, body = _oversized_chunked(gateway.port)
        if outcome == "reset":
            continue
        assert outcome == "413", body
        assert b"body_too_large" in body
        return
    pytest.fail("three resets in a row: the 413 answer never arrived")


def test_oversized_chunked_bodies_never_hang(gateway: UpProcess) -> None:
    """Body arriving before extproc's answer to the headers is still refused, never left paused.

    Envoy buffered such a body under flow control while extproc decided; when extproc then
    asked for the whole body, Envoy waited for bytes it had stopped reading (about 3% of these
    uploads at 4 concurrent clients hung until the stream idle timeout).
    """
    import collections
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outcomes = collections.Counter(pool.map(lambda _: _oversized_chunked(gateway.port)[0], range(200)))
    assert outcomes["no answer"] == 0, outcomes
    assert set(outcomes) <= {"413", "reset"}, outcomes
    assert outcomes["413"] >= 150, outcomes


def test_unknown_model_by_header(gateway: UpProcess) -> None:
    assert_error(post(gateway, GOOD, {"x-model-id": "nope"}), 404, "model_not_found")


def test_bad_model_path(gateway: UpProcess) -> None:
    assert_error(post(gateway, GOOD, path="/model/"), 400, "invalid_path")


@pytest.mark.parametrize("good", [GOOD, GOOD_N])
def test_missing_and_invalid_token(gateway: UpProcess, good: dict[str, object]) -> None:
    no_auth = request("POST", f"{gateway.url}/v1/chat/completions", body=good)
    assert_error(no_auth, 401, "invalid_api_key")
    wrong = request(
        "POST", f"{gateway.url}/v1/chat/completions", body=good, headers={"authorization": "Bearer sk-wrong"}
    )
    assert_error(wrong, 401, "invalid_api_key")
    models = request("GET", f"{gateway.url}/v1/models")
    assert_error(models, 401, "invalid_api_key")
    # /healthz stays open; /metrics is not on the public listener by default (tests/gateway/test_keys.py).
    assert request("GET", f"{gateway.url}/healthz").status == 200


def transcription(gateway: UpProcess, boundary: str, parts: str) -> Response:
    """A multipart upload to /v1/audio/transcriptions (`parts`: the form between the boundaries)."""
    body = f"--{boundary}\r\n{parts}\r\n--{boundary}--\r\n".encode()
    content_type = {"content-type": f"multipart/form-data; boundary={boundary}"}
    return post(gateway, body, content_type, path="/v1/audio/transcriptions")


def test_multipart_without_model(gateway: UpProcess) -> None:
    file_part = (
        'Content-Disposition: form-data; name="file"; filename="a.wav"\r\nContent-Type: audio/wav\r\n\r\nRIFF....'
    )
    assert_error(transcription(gateway, "XyZ", file_part), 400, "model_required")


def test_multipart_with_model_is_routed_unchanged(gateway: UpProcess) -> None:
    response = transcription(gateway, "b0undary", 'Content-Disposition: form-data; name="model"\r\n\r\nchat-b')
    # Routed to chat-b's backend (the simulator has no audio endpoint: its own 404 proves the hop).
    assert "x-wakegate-upstream" in response.headers
    assert response.headers["x-wakegate-upstream"] in set(gateway.endpoints("chat-b"))


def test_rate_limit_answers_429_with_retry_after(gateway: UpProcess) -> None:
    # chat-r: burst 2, one bucket in Envoy whichever extproc a request reaches (a fresh start
    # each time: tests/gateway/test_ratelimit_startup.py).
    statuses = [post(gateway, {**GOOD, "model": "chat-r"}) for _ in range(6)]
    codes = [r.status for r in statuses]
    assert codes == [200, 200, 429, 429, 429, 429], codes
    limited = statuses[2]
    assert_error(limited, 429, "rate_limited")
    assert int(limited.headers["retry-after"]) >= 1


def test_cold_model_in_reject_mode_wakes_and_recovers(gateway: UpProcess) -> None:
    response = post(gateway, {**GOOD, "model": "chat-cold"})
    assert_error(response, 503, "model_not_ready")
    assert int(response.headers["retry-after"]) >= 1
    # The rejected request still counted as demand: the model starts, and a retry is answered.
    deadline = time.monotonic() + 20
    while (retry := post(gateway, {**GOOD, "model": "chat-cold"})).status == 503:
        assert time.monotonic() < deadline, "reject-mode model never became ready"
        time.sleep(0.2)
    assert retry.status == 200, retry.text


def test_key_rotation_needs_no_restart(gateway: UpProcess, keys_file: Path) -> None:
    """A key added to the file is taken by extproc (decided requests, /v1/models) and by Envoy
    (the native model's routes) within seconds; removed, it is refused by both again."""
    new_key = {"authorization": "Bearer sk-rotated-key-9876543210"}

    def statuses() -> set[int]:
        return {
            request("GET", f"{gateway.url}/v1/models", headers=new_key).status,
            post(gateway, GOOD, new_key).status,
            post(gateway, GOOD_N, new_key).status,
        }

    keys_file.write_text(f"{KEYS_TEXT}{new_key['authorization'].split()[1]}\n")
    deadline = time.monotonic() + 5
    while (seen := statuses()) != {200}:
        assert time.monotonic() < deadline, f"rotated key not accepted on both paths within 5 s: {seen}"
        time.sleep(0.2)
    keys_file.write_text(KEYS_TEXT)
    deadline = time.monotonic() + 5
    while (seen := statuses()) != {401}:
        assert time.monotonic() < deadline, f"revoked key still accepted after 5 s: {seen}"
        time.sleep(0.2)


def test_gateway_still_serves_after_bad_input(gateway: UpProcess) -> None:
    for good in (GOOD, GOOD_N):
        r = post(gateway, good)
        assert r.status == 200, (r.text, r.headers)
        assert r.headers["x-wakegate-upstream"] in set(gateway.endpoints("chat-a" if good is GOOD else NATIVE))
    log = gateway.log()
    for log in ("extproc-0.log", "extproc-1.log"):
        assert "Traceback" not in (gateway.state_dir / "logs" / log).read_text()
    assert API_KEY not in log
