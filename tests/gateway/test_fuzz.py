"""Fuzzing the whole gateway (real Envoy, extproc and backends) with what clients may send.

Hypothesis builds request bodies (JSON of every shape, nested past the limit, `model` twice,
lone surrogate escapes, bytes that are not UTF-8, multipart forms) and request heads (methods,
paths with percent escapes, header names and values with any byte but CR and LF, content
types, keys). Each goes out on a bare socket. Every reply must be JSON with a 2xx or 4xx
status; every reply the gateway makes itself must be the OpenAI error shape; no log may hold
a traceback. Runs are bounded and derandomized: the same inputs every time.
"""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway.conftest import API_KEY
from tests.support.rawhttp import Reply, http1
from tests.support.up import UpProcess

FUZZ = settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

#: Names that route (chat-l's slow backend and the cold model are left out), and ones that do not.
NAMES = ["a", "gpt-a", "chat-a", "org/chat-a", "a-sql", "b", "chat-b", "chat-p", "chat-r", "nope", "", " a", "x" * 300]
PATHS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/audio/transcriptions",
    "/v1/models",
    "/v1/models/a",
    "/healthz",
    "/",
]

leaves = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40)
)
values = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=25,
)
models = st.one_of(st.sampled_from(NAMES), st.text(max_size=12), values)


@st.composite
def json_bodies(draw: st.DrawFn) -> bytes:
    document = draw(st.dictionaries(st.text(max_size=12), values, max_size=5))
    if draw(st.booleans()):
        document["model"] = draw(models)
    if draw(st.booleans()):
        document["messages"] = [{"role": "user", "content": draw(st.text(max_size=60))}]
    document["max_tokens"] = draw(st.one_of(st.just(1), values))
    text = json.dumps(document, ensure_ascii=draw(st.booleans()))
    twist = draw(st.sampled_from(["none", "deep", "twice", "surrogate", "not-utf8", "cut", "number"]))
    if twist == "deep":
        depth = draw(st.integers(100, 5000))
        text = text[:-1] + ', "deep": ' + "[" * depth + "]" * depth + "}"
    elif twist == "twice":
        text = text[:-1] + ', "model": ' + json.dumps(draw(st.sampled_from(NAMES))) + "}"
    elif twist == "surrogate":
        escape = draw(st.sampled_from(["\\ud800", "\\udfff", "\\ude00\\ud83d", "\\ud83d"]))
        text = text[:-1] + f', "s": "{escape}"}}'
    elif twist == "number":
        text = text[:-1] + ', "n": ' + draw(st.sampled_from(["1e999999", "-0", "9" * 5000, "NaN", "0x1"])) + "}"
    raw = text.encode("utf-8", "surrogatepass")
    if twist == "not-utf8":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"])) + raw[at:]
    elif twist == "cut":
        raw = raw[: draw(st.integers(0, len(raw)))]
    return raw


@st.composite
def multipart_bodies(draw: st.DrawFn) -> tuple[bytes, str]:
    boundary = draw(st.text(st.characters(codec="latin-1", exclude_characters='\r\n";'), min_size=1, max_size=12))
    parts = []
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(["model", "file", "x", '"model"', "mod\xe9l"]))
        value = draw(st.one_of(st.sampled_from(NAMES).map(str.encode), st.binary(max_size=30)))
        parts.append(f'Content-Disposition: form-data; name="{name}"\r\n\r\n'.encode("latin-1") + value)
    delimiter = b"--" + boundary.encode("latin-1")
    body = b"".join(delimiter + b"\r\n" + part + b"\r\n" for part in parts) + delimiter + b"--\r\n"
    return body, f"multipart/form-data; boundary={boundary}"


header_names = st.text(st.characters(codec="latin-1", exclude_characters="\r\n:"), min_size=1, max_size=12)
header_values = st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))


def raw_request(
    method: str, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes, *, chunked: bool = False
) -> bytes:
    head = [method.encode() + b" " + path + b" HTTP/1.1", b"host: gateway"]
    head += [name + b": " + value for name, value in headers]
    if chunked:
        head.append(b"transfer-encoding: chunked")
        body = (b"%x\r\n" % len(body) + body + b"\r\n" if body else b"") + b"0\r\n\r\n"
    else:
        head.append(b"content-length: %d" % len(body))
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def check(reply: Reply, sent: bytes) -> None:
    assert reply.ended == "", (reply, sent[:300])
    assert 200 <= reply.status < 300 or 400 <= reply.status < 500, (reply, sent[:300])
    if "x-wakegate-upstream" in reply.headers:
        return  # the backend's own answer (a completion, a stream, its own error)
    if reply.status >= 400:
        reply.error()  # the OpenAI shape, or the test fails
    else:
        json.loads(reply.body)


def assert_no_traceback(gateway: UpProcess) -> None:
    logs = [gateway.log_path, *Path(gateway.state_dir / "logs").glob("*.log")]
    for path in logs:
        text = path.read_text(errors="replace")
        assert "Traceback" not in text, f"{path.name}:\n{text[text.index('Traceback') - 2000 :][:6000]}"
    assert API_KEY not in "".join(p.read_text(errors="replace") for p in logs)


@FUZZ
@given(
    body=st.one_of(json_bodies(), multipart_bodies(), st.binary(max_size=200)),
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/audio/transcriptions"]),
    chunked=st.booleans(),
)
def test_fuzzed_bodies_get_shaped_answers(gateway: UpProcess, body: object, path: str, chunked: bool) -> None:
    if isinstance(body, tuple):
        data, content_type = body
    else:
        data, content_type = body, "application/json"  # type: ignore[assignment]
    headers = [(b"authorization", b"Bearer " + API_KEY.encode()), (b"content-type", content_type.encode("latin-1"))]
    sent = raw_request("POST", path.encode(), headers, data, chunked=chunked)  # type: ignore[arg-type]
    check(http1(gateway.port, sent), sent)


@FUZZ
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "G@T"]),
    path=st.one_of(
        st.sampled_from(PATHS),
        st.builds(lambda name: f"/model/{name}/v1/chat/completions", st.text(max_size=20)),
        st.text(max_size=30).map(lambda t: "/" + t),
    ).map(lambda p: p.encode("utf-8", "surrogatepass").replace(b"\r", b"%0D").replace(b"\n", b"%0A")),
    model_header=st.one_of(st.none(), models.map(lambda m: json.dumps(m)[1:-1] if isinstance(m, str) else str(m))),
    key=st.sampled_from([API_KEY, API_KEY, API_KEY, "", "sk-wrong", API_KEY + "x"]),
    content_type=st.sampled_from(["application/json", "text/plain", "", "multipart/form-data", "application/json; x"]),
    extra=st.lists(st.tuples(header_names, header_values), max_size=4),
    body=st.one_of(st.just(b'{"model": "a", "max_tokens": 1}'), json_bodies(), st.binary(max_size=60)),
)
def test_fuzzed_request_heads_get_shaped_answers(
    gateway: UpProcess,
    method: str,
    path: bytes,
    model_header: str | None,
    key: str,
    content_type: str,
    extra: list[tuple[str, bytes]],
    body: bytes,
) -> None:
    headers = [(b"authorization", b"Bearer " + key.encode()), (b"content-type", content_type.encode())]
    if model_header is not None:
        headers.append((b"x-model-id", model_header.encode("utf-8", "surrogatepass").replace(b"\\", b"")))
    headers += [(name.encode("latin-1"), value) for name, value in extra]
    sent = raw_request(method, path, headers, body)
    check(http1(gateway.port, sent), sent)


def test_after_the_fuzz_no_log_holds_a_traceback_and_the_gateway_serves(gateway: UpProcess) -> None:
    ok = raw_request(
        "POST",
        b"/v1/chat/completions",
        [(b"authorization", b"Bearer " + API_KEY.encode()), (b"content-type", b"application/json")],
        b'{"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}',
    )
    assert http1(gateway.port, ok).status == 200
    assert_no_traceback(gateway)
