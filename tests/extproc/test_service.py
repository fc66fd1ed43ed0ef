"""extproc's orchestrator on its own: ext_proc messages in, Envoy instructions out, no Envoy.

The same decisions run through the real Envoy in tests/gateway and tests/cold; here each one
is looked at in the message Envoy would receive: immediate responses (status, OpenAI-shaped
body, headers), header and body mutations, dynamic metadata and processing-mode overrides.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from wakegate import contract
from wakegate.extproc.auth import ApiKeys
from wakegate.extproc.exchange import Cold, Exchange
from wakegate.extproc.gateway import Gateway, Settings
from wakegate.extproc.h2grpc.call import INVALID_ARGUMENT
from wakegate.extproc.process_call import ProcessCall
from wakegate.extproc.service import Processor
from wakegate.v1 import routing_pb2


def route(
    key: str,
    *endpoints: str,
    names: tuple[str, ...] = (),
    served: str = "",
    strategy: str = "least-loaded",
    cold: str = "hold",
    rps: float = 0.0,
    adapters: tuple[str, ...] = (),
) -> routing_pb2.ModelRoute:
    return routing_pb2.ModelRoute(
        key=key,
        names=[key, *names],
        served_name=served or key,
        lora_adapters=list(adapters),
        cluster=f"model.{key}",
        strategy=contract.STRATEGIES[strategy],
        rate_limit=routing_pb2.RateLimit(requests_per_second=rps, burst=rps),
        endpoints=[routing_pb2.Endpoint(address=e.split(":")[0], port=int(e.split(":")[1])) for e in endpoints],
        cold=routing_pb2.ColdPolicy(mode=contract.COLD_MODES[cold], max_queue=2, activation_timeout_ms=5000),
    )


ROUTES = [
    route("chat", "10.0.0.1:8000", "10.0.0.2:8000", names=("small",), served="org/chat", adapters=("chat-sql",)),
    route("limited", "10.0.0.3:8000", rps=1),
    route("sleepy", cold="reject"),
    route("waiting"),
    route("streamer", cold="keepalive"),
]


def gateway(keys: ApiKeys | None = None, **settings: Any) -> Gateway:
    gw = Gateway(Settings(**settings), keys or ApiKeys(None))
    gw.set_routes(ROUTES)
    return gw


def headers(path: str, *, method: str = "POST", end: bool = False, **extra: str) -> ep.ProcessingRequest:
    fields = {":path": path, ":method": method, "content-type": "application/json", **extra}
    http = ep.HttpHeaders(end_of_stream=end)
    for name, value in fields.items():
        http.headers.headers.add(key=name, raw_value=value.encode())
    return ep.ProcessingRequest(request_headers=http)


def body(data: dict[str, Any] | bytes) -> ep.ProcessingRequest:
    raw = data if isinstance(data, bytes) else json.dumps(data).encode()
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=raw, end_of_stream=True))


def decide(proc: Processor, *messages: ep.ProcessingRequest) -> tuple[Exchange, Any]:
    exchange = Exchange()
    decided: Any = None
    for message in messages:
        decided = proc.decide(exchange, message)
    return exchange, decided


def immediate(response: ep.ProcessingResponse) -> tuple[int, dict[str, str], Any]:
    assert response.WhichOneof("response") == "immediate_response"
    answer = response.immediate_response
    sent = {h.header.key: h.header.raw_value.decode() for h in answer.headers.set_headers}
    try:
        payload = json.loads(answer.body)
    except ValueError:
        payload = answer.body
    return answer.status.code, sent, payload


def set_headers(common: ep.CommonResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def test_healthz_answers_without_auth(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k1\n")
    proc = Processor(gateway(ApiKeys(keys)))
    status, _, payload = immediate(decide(proc, headers("/healthz", method="GET", end=True))[1])
    assert (status, payload) == (200, {"status": "ok"})


def metrics_status(proc: Processor, **extra: str) -> tuple[int, Any]:
    status, sent, payload = immediate(decide(proc, headers("/metrics", method="GET", end=True, **extra))[1])
    if status == 200:
        assert sent["content-type"].startswith("text/plain") and b"wakegate_gateway_models" in payload
    return status, payload


def test_public_metrics_off_by_default(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k1\n")
    proc = Processor(gateway(ApiKeys(keys)))
    for extra in ({}, {"authorization": "Bearer k1"}):
        status, payload = metrics_status(proc, **extra)
        assert status == 404 and payload["error"]["code"] == "not_found"


def test_public_metrics_open_and_behind_keys(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k1\nk2 chat\n")
    assert metrics_status(Processor(gateway(ApiKeys(keys), public_metrics="open")))[0] == 200
    behind = Processor(gateway(ApiKeys(keys), public_metrics="keys"))
    assert metrics_status(behind)[0] == 401
    assert metrics_status(behind, authorization="Bearer nope")[0] == 401
    assert metrics_status(behind, authorization="Bearer k1")[0] == 200
    assert metrics_status(behind, authorization="Bearer k2")[0] == 200  # any valid key, scoped or not


def scoped(tmp_path: Path, text: str = "all\nmine chat,waiting\n") -> tuple[Gateway, Processor]:
    keys = tmp_path / "keys"
    keys.write_text(text)
    gw = gateway(ApiKeys(keys))
    return gw, Processor(gw)


@pytest.mark.parametrize(
    "message",
    [
        lambda: [headers("/v1/completions", **{"x-model-id": "limited", "authorization": "Bearer mine"})],
        lambda: [headers("/model/limited/v1/completions", authorization="Bearer mine")],
        lambda: [headers("/v1/completions", authorization="Bearer mine"), body({"model": "limited"})],
        lambda: [headers("/v1/completions", **{"x-model-id": "sleepy", "authorization": "Bearer mine"})],
    ],
    ids=["header", "path", "body", "cold"],
)
def test_scoped_key_cannot_reach_another_model(tmp_path: Path, message: Any) -> None:
    gw, proc = scoped(tmp_path)
    status, _, payload = immediate(decide(proc, *message())[1])
    assert status == 404 and payload["error"]["code"] == "model_not_found"
    # Nothing else happened: no demand (the cold model is not woken), no rate-limit token taken.
    assert gw.cold.snapshot() == {} and gw.in_flight == {}
    limited = headers("/v1/completions", **{"x-model-id": "limited", "authorization": "Bearer all"})
    assert decide(proc, limited)[1].WhichOneof("response") == "request_headers"


def test_scoped_key_reaches_its_model_by_every_name(tmp_path: Path) -> None:
    _, proc = scoped(tmp_path)
    for name in ("chat", "small", "org/chat", "chat-sql"):  # own name, alias, served name, adapter
        decided = decide(proc, headers("/v1/x", **{"x-model-id": name, "authorization": "Bearer mine"}))[1]
        assert decided.WhichOneof("response") == "request_headers", name
        assert set_headers(decided.request_headers.response)[contract.CLUSTER_HEADER] == "model.chat"


def test_unknown_and_forbidden_models_look_the_same(tmp_path: Path) -> None:
    _, proc = scoped(tmp_path)
    mine = {"authorization": "Bearer mine"}
    forbidden = immediate(decide(proc, headers("/v1/x", **{"x-model-id": "limited", **mine}))[1])
    unknown = immediate(decide(proc, headers("/v1/x", **{"x-model-id": "nope", **mine}))[1])
    assert forbidden[0] == unknown[0] == 404
    assert forbidden[2]["error"]["message"].replace("limited", "nope") == unknown[2]["error"]["message"]


def test_models_list_shows_only_the_keys_models(tmp_path: Path) -> None:
    _, proc = scoped(tmp_path)
    get = {"method": "GET", "end": True}
    _, _, listing = immediate(decide(proc, headers("/v1/models", **get, authorization="Bearer mine"))[1])
    assert {m["id"] for m in listing["data"]} == {"chat", "small", "org/chat", "chat-sql", "waiting"}
    _, _, full = immediate(decide(proc, headers("/v1/models", **get, authorization="Bearer all"))[1])
    assert {"limited", "sleepy", "streamer"} <= {m["id"] for m in full["data"]}
    assert immediate(decide(proc, headers("/v1/models/small", **get, authorization="Bearer mine"))[1])[0] == 200
    status, _, payload = immediate(decide(proc, headers("/v1/models/limited", **get, authorization="Bearer mine"))[1])
    assert status == 404 and payload["error"]["code"] == "model_not_found"


def test_scoped_listing_follows_route_changes(tmp_path: Path) -> None:
    gw, proc = scoped(tmp_path)
    listed = headers("/v1/models", method="GET", end=True, authorization="Bearer mine")
    assert "waiting" in {m["id"] for m in immediate(decide(proc, listed)[1])[2]["data"]}
    gw.set_routes([r for r in ROUTES if r.key != "waiting"])
    assert "waiting" not in {m["id"] for m in immediate(decide(proc, listed)[1])[2]["data"]}


def test_a_missing_or_wrong_key_is_401_and_a_good_one_passes(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k1\n")
    proc = Processor(gateway(ApiKeys(keys)))
    status, _, payload = immediate(decide(proc, headers("/v1/models", method="GET", end=True))[1])
    assert status == 401 and payload["error"]["code"] == "invalid_api_key"
    wrong = headers("/v1/models", method="GET", end=True, authorization="Bearer nope")
    assert immediate(decide(proc, wrong)[1])[0] == 401
    good = headers("/v1/models", method="GET", end=True, authorization="Bearer k1")
    assert immediate(decide(proc, good)[1])[0] == 200


def test_models_list_and_retrieve_come_from_the_route_table() -> None:
    proc = Processor(gateway())
    _, _, listing = immediate(decide(proc, headers("/v1/models", method="GET", end=True))[1])
    ids = {m["id"] for m in listing["data"]}
    assert {"chat", "small", "org/chat", "chat-sql", "limited"} <= ids
    _, _, one = immediate(decide(proc, headers("/v1/models/org%2Fchat", method="GET", end=True))[1])
    assert one == {"id": "org/chat", "object": "model", "created": 0, "owned_by": "wakegate", "root": "org/chat"}
    _, _, adapter = immediate(decide(proc, headers("/v1/models/chat-sql", method="GET", end=True))[1])
    assert adapter["parent"] == "org/chat"
    status, _, missing = immediate(decide(proc, headers("/v1/models/nope", method="GET", end=True))[1])
    assert status == 404 and missing["error"] == {
        "message": "model 'nope' does not exist",
        "type": "not_found_error",
        "code": "model_not_found",
    }


def test_header_named_model_is_routed_at_once_with_its_pick() -> None:
    gw = gateway()
    proc = Processor(gw)
    exchange, decided = decide(proc, headers("/v1/chat/completions", **{"x-model-id": "small"}))
    assert decided.WhichOneof("response") == "request_headers"
    assert decided.mode_override.request_body_mode == processing_mode_pb2.ProcessingMode.NONE
    mutations = set_headers(decided.request_headers.response)
    assert mutations[contract.CLUSTER_HEADER] == "model.chat"
    picked = mutations[contract.DESTINATION_HEADER]
    assert picked in ("10.0.0.1:8000", "10.0.0.2:8000")
    lb = decided.dynamic_metadata.fields[contract.LB_METADATA_NAMESPACE].struct_value
    assert lb.fields[contract.DESTINATION_HEADER].string_value == picked
    assert gw.in_flight == {"chat": 1}
    proc.release(exchange)
    proc.release(exchange)  # released once only
    assert gw.in_flight == {}


def test_path_prefix_is_stripped_and_client_destination_removed() -> None:
    proc = Processor(gateway())
    request = headers("/model/chat/v1/chat/completions", **{contract.DESTINATION_HEADER: "10.9.9.9:1"})
    _, decided = decide(proc, request)
    common = decided.request_headers.response
    assert set_headers(common)[":path"] == "/v1/chat/completions"
    assert set_headers(common)[contract.DESTINATION_HEADER] != "10.9.9.9:1"


def test_body_named_model_is_buffered_then_rewritten() -> None:
    proc = Processor(gateway())
    exchange = Exchange()
    first = proc.decide(exchange, headers("/v1/chat/completions"))
    assert first.mode_override.request_body_mode == processing_mode_pb2.ProcessingMode.BUFFERED
    decided = proc.decide(exchange, body({"model": "small", "messages": []}))
    common = decided.request_body.response
    assert json.loads(common.body_mutation.body) == {"model": "org/chat", "messages": []}
    assert set_headers(common)["content-length"] == str(len(common.body_mutation.body))
    # A LoRA adapter keeps its own name: the body is left alone.
    adapter = proc.decide(Exchange(), headers("/v1/completions", **{"x-model-id": "chat-sql"}))
    assert not adapter.request_headers.response.HasField("body_mutation")


@pytest.mark.parametrize(
    ("request_", "status", "code"),
    [
        (headers("/v1/chat/completions", end=True), 400, "model_required"),
        (headers("/v1/chat/completions", **{"content-type": "text/plain"}), 415, "unsupported_media_type"),
        (headers("/v1/chat/completions", **{"content-length": "999999999"}), 413, "body_too_large"),
        (headers("/v1/chat/completions", **{"x-model-id": "nope"}), 404, "model_not_found"),
        (headers("/model/", **{}), 400, "invalid_path"),
    ],
)
def test_bad_requests_get_openai_shaped_errors(request_: ep.ProcessingRequest, status: int, code: str) -> None:
    got_status, sent, payload = immediate(decide(Processor(gateway()), request_)[1])
    assert (got_status, payload["error"]["code"]) == (status, code)
    assert sent["content-type"] == "application/json"


def test_rate_limit_refuses_with_retry_after() -> None:
    proc = Processor(gateway())
    limited = headers("/v1/completions", **{"x-model-id": "limited"})
    assert decide(proc, limited)[1].WhichOneof("response") == "request_headers"
    status, sent, payload = immediate(decide(proc, limited)[1])
    assert status == 429 and payload["error"]["code"] == "rate_limited" and int(sent["retry-after"]) >= 1


def test_a_request_envoy_counted_takes_no_second_token_and_only_envoy_can_say_so() -> None:
    """`counted_by_envoy`: Envoy's bucket took the token of the requests it marked with the model's
    key. An unmarked request (one Envoy could not name: a multipart form, a GET) still takes its
    token here, and on a model Envoy does not count a mark changes nothing."""
    counted = route("counted", "10.0.0.4:8000", rps=1)
    counted.rate_limit.counted_by_envoy = True
    gw = gateway()
    gw.set_routes([*ROUTES, counted])
    proc = Processor(gw)

    def status(key: str, mark: str | None) -> str | None:
        extra = {"x-model-id": key, **({contract.RATE_COUNTED_HEADER: mark} if mark is not None else {})}
        return decide(proc, headers("/v1/completions", **extra))[1].WhichOneof("response")

    assert [status("counted", "counted") for _ in range(5)] == ["request_headers"] * 5
    # Its own bucket (burst 1) still counts what Envoy did not: the first passes, the next is refused.
    assert [status("counted", mark) for mark in (None, "chat")] == ["request_headers", "immediate_response"]
    assert [status("limited", "limited") for _ in range(2)] == ["request_headers", "immediate_response"]


def test_the_gateway_wide_token_envoy_took_is_not_taken_again_and_only_where_envoy_keeps_that_bucket() -> None:
    """`global_counted_by_envoy`: Envoy's gateway-wide bucket took the token of the requests it
    marked. Where Envoy counts only the model's bucket, a marked request still takes a global token."""
    both = route("both", "10.0.0.4:8000")
    both.rate_limit.counted_by_envoy = both.rate_limit.global_counted_by_envoy = True
    model_only = route("model-only", "10.0.0.5:8000")
    model_only.rate_limit.counted_by_envoy = True
    gw = gateway(global_rate=1, global_burst=1)
    gw.set_routes([*ROUTES, both, model_only])
    proc = Processor(gw)

    def status(key: str, mark: bool) -> str | None:
        extra = {"x-model-id": key, **({contract.RATE_COUNTED_HEADER: key} if mark else {})}
        return decide(proc, headers("/v1/completions", **extra))[1].WhichOneof("response")

    assert [status("both", True) for _ in range(5)] == ["request_headers"] * 5
    # The global bucket here (burst 1) counts the rest: one passes, then nothing does.
    assert [status("model-only", True), status("model-only", True)] == ["request_headers", "immediate_response"]
    assert status("both", False) == "immediate_response"


async def test_cold_reject_registers_demand_then_answers_503() -> None:
    gw = gateway()
    status, sent, payload = immediate(decide(Processor(gw), headers("/v1/x", **{"x-model-id": "sleepy"}))[1])
    assert (status, payload["error"]["code"], sent["retry-after"]) == (503, "model_not_ready", "5")
    assert gw.cold.snapshot()["sleepy"][1] == 1  # the activation lease started


async def test_cold_keepalive_stream_goes_to_the_activator() -> None:
    proc = Processor(gateway())
    exchange = Exchange()
    proc.decide(exchange, headers("/v1/chat/completions"))
    decided = proc.decide(exchange, body({"model": "streamer", "stream": True}))
    mutations = set_headers(decided.request_body.response)
    assert mutations[contract.CLUSTER_HEADER] == contract.ACTIVATOR_CLUSTER
    assert mutations[contract.ACTIVATOR_MODEL_HEADER] == "streamer"


async def test_a_held_request_is_sent_on_when_its_model_becomes_ready() -> None:
    gw = gateway()
    proc = Processor(gw)
    exchange, cold = decide(proc, headers("/v1/x", **{"x-model-id": "waiting"}))
    assert isinstance(cold, Cold)
    held = asyncio.create_task(proc.hold(exchange, cold, exchange.started + 5))
    await asyncio.sleep(0.01)
    assert gw.queue_view()["models"][-1] == {
        "model": "waiting",
        "queued": 1,
        "leases": 1,
        "in_flight": 0,
        "ready_endpoints": 0,
    }
    gw.set_routes([*ROUTES[:3], route("waiting", "10.0.0.9:8000"), ROUTES[4]])
    decided = await asyncio.wait_for(held, 2)
    assert set_headers(decided.request_headers.response)[contract.DESTINATION_HEADER] == "10.0.0.9:8000"
    assert gw.in_flight == {"waiting": 1}


async def test_a_request_held_by_flow_control_while_its_model_wakes_gets_the_activations_failure() -> None:
    gw = gateway()
    cold = route("fair")
    cold.flow.CopyFrom(
        routing_pb2.FlowControl(enabled=True, band="standard", max_queue=4, queue_timeout_ms=5000, max_in_flight=1)
    )
    gw.set_routes([*ROUTES, cold])
    proc = Processor(gw)
    exchange, held = decide(proc, headers("/v1/x", **{"x-model-id": "fair"}))
    assert isinstance(held, Cold) and held.ticket is not None  # in flow control's queues while it wakes
    task = asyncio.create_task(proc.hold(exchange, held, exchange.started + held.timeout_s()))
    await asyncio.sleep(0.01)
    assert [m["queued"] for m in gw.queue_view()["models"] if m["model"] == "fair"] == [1]
    failed = routing_pb2.ModelRoute()
    failed.CopyFrom(cold)
    failed.failed_activations = 1
    failed.last_failure = "the engine exited"
    gw.set_routes([*ROUTES, failed])
    status, sent, payload = immediate(await asyncio.wait_for(task, 2))
    assert (status, payload["error"]["code"], sent["retry-after"]) == (503, "activation_failed", "5")
    assert "the engine exited" in payload["error"]["message"] and gw.flow.depth("fair") == 0


def test_routes_that_go_away_drop_their_hash_rings() -> None:
    gw = gateway()
    affinity = route("sticky", "10.0.0.5:1", "10.0.0.6:1", strategy="session-affinity")
    gw.set_routes([*ROUTES, affinity])
    proc = Processor(gw)
    decide(proc, headers("/v1/x", **{"x-model-id": "sticky", "x-session-id": "s1"}))
    assert "sticky" in gw.picker._rings
    gw.set_routes(ROUTES)
    assert "sticky" not in gw.picker._rings


class FakeCall:
    """What ProcessCall sees of its gRPC call (the server side is tested in tests/extproc/h2grpc)."""

    def __init__(self) -> None:
        self.sent: list[ep.ProcessingResponse] = []
        self.status: tuple[int, str] | None = None

    @property
    def finished(self) -> bool:
        return self.status is not None

    def send(self, data: bytes) -> None:
        self.sent.append(ep.ProcessingResponse.FromString(data))

    def finish(self, status: int = 0, message: str = "") -> None:
        self.status = (status, message)


def test_stream_answers_each_message_and_releases_on_half_close() -> None:
    gw = gateway()
    call = FakeCall()
    stream = ProcessCall(Processor(gw), call)  # type: ignore[arg-type]
    stream.on_message(headers("/v1/x", **{"x-model-id": "chat"}).SerializeToString())
    assert len(call.sent) == 1 and gw.in_flight == {"chat": 1}
    stream.on_half_close()
    assert call.status == (0, "") and gw.in_flight == {}


def test_stream_refuses_what_is_not_an_ext_proc_message() -> None:
    call = FakeCall()
    ProcessCall(Processor(gateway()), call).on_message(b"\xff\xff garbage")  # type: ignore[arg-type]
    assert call.status == (INVALID_ARGUMENT, "not an ext_proc ProcessingRequest")


async def test_a_reset_while_held_frees_the_queue_slot() -> None:
    gw = gateway()
    call = FakeCall()
    stream = ProcessCall(Processor(gw), call)  # type: ignore[arg-type]
    stream.on_message(headers("/v1/x", **{"x-model-id": "waiting"}).SerializeToString())
    assert call.sent[0].HasField("override_message_timeout")  # Envoy is told to wait longer
    await asyncio.sleep(0.01)
    assert gw.cold.depth("waiting") == 1
    stream.on_cancel()
    await asyncio.sleep(0.01)
    assert gw.cold.depth("waiting") == 0 and gw.in_flight == {}


async def test_a_stopping_extproc_answers_its_held_requests_with_the_retriable_unserved_503() -> None:
    gw = gateway()
    proc = Processor(gw)
    held, done = FakeCall(), FakeCall()
    ProcessCall(proc, held).on_message(headers("/v1/x", **{"x-model-id": "waiting"}).SerializeToString())  # type: ignore[arg-type]
    ProcessCall(proc, done).on_message(headers("/v1/x", **{"x-model-id": "chat"}).SerializeToString())  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    assert proc.let_go() == 1
    status, extra, answer = immediate(held.sent[-1])
    # Answered, not cut: a cut stream would be sent through the gateway again, to no extproc.
    assert status == 503 and answer["error"]["code"] == "gateway_unavailable"
    assert extra["retry-after"] == "1" and extra[contract.UNSERVED_HEADER] == "1" and held.status == (0, "")
    await asyncio.sleep(0.01)
    assert gw.cold.depth("waiting") == 0 and proc.holding == set() and len(done.sent) == 1


def multipart(value: bytes) -> tuple[ep.ProcessingRequest, ep.ProcessingRequest]:
    form = b'--B\r\nContent-Disposition: form-data; name="model"\r\n\r\n' + value + b"\r\n--B--\r\n"
    return headers("/v1/audio/transcriptions", **{"content-type": "multipart/form-data; boundary=B"}), body(form)


@pytest.mark.parametrize(
    ("messages", "code"),
    [
        # Each of these once raised inside extproc: a 500 from Envoy and a traceback in the log.
        (
            (headers("/v1/chat/completions"), body(b'{"model": "chat", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}")),
            "json_too_deep",
        ),
        (
            (headers("/v1/chat/completions"), body(b'{"model": "small", "messages": [{"content": "\\ud800"}]}')),
            "invalid_unicode",
        ),
        (multipart(b"ch\xffat"), "invalid_model"),
        ((headers("/v1/chat/completions"), body(b'{"model": "chat", "model": "small"}')), "duplicate_model"),
        (multipart(b'chat\r\n--B\r\nContent-Disposition: form-data; name="model"\r\n\r\nsmall'), "duplicate_model"),
    ],
)
def test_bodies_the_gateway_cannot_read_as_a_backend_would_are_400(
    messages: tuple[ep.ProcessingRequest, ...], code: str, caplog: pytest.LogCaptureFixture
) -> None:
    gw = gateway()
    with caplog.at_level(logging.INFO, logger="wakegate.extproc"):
        status, _, payload = immediate(decide(Processor(gw), *messages)[1])
    assert (status, payload["error"]["code"]) == (400, code)
    assert payload["error"]["type"] == "invalid_request_error" and payload["error"]["message"]
    assert gw.in_flight == {}
    [line] = [r for r in caplog.records if r.name == "wakegate.extproc"]
    assert code in line.getMessage() and line.exc_info is None


def test_a_lone_surrogate_passes_unchanged_when_the_model_needs_no_rewrite() -> None:
    raw = b'{"model": "org/chat", "messages": [{"content": "\\ud800"}]}'
    _, decided = decide(Processor(gateway()), headers("/v1/chat/completions"), body(raw))
    assert not decided.request_body.response.HasField("body_mutation")


def test_a_flood_of_refusals_writes_a_few_lines_not_one_each(caplog: pytest.LogCaptureFixture) -> None:
    proc = Processor(gateway())
    with caplog.at_level(logging.INFO, logger="wakegate.extproc"):
        for _ in range(500):
            decide(proc, headers("/v1/chat/completions"), body(b"{not json"))
    lines = [r for r in caplog.records if r.name == "wakegate.extproc"]
    assert 1 <= len(lines) <= 10 and all("invalid_json" in r.getMessage() for r in lines)


def test_a_failure_inside_extproc_is_a_shaped_500_and_one_line(caplog: pytest.LogCaptureFixture) -> None:
    gw = gateway()

    def broken(name: str) -> None:
        raise KeyError(name)

    gw.table.resolve = broken  # type: ignore[method-assign]
    call = FakeCall()
    stream = ProcessCall(Processor(gw), call)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="wakegate.extproc"):
        stream.on_message(headers("/v1/x", **{"x-model-id": "chat"}).SerializeToString())
    status, sent, payload = immediate(call.sent[0])
    assert (status, payload["error"]["code"], sent["content-type"]) == (500, "internal_error", "application/json")
    [line] = caplog.records
    assert line.getMessage() == "request failed: KeyError" and line.exc_info is None
    stream.on_half_close()
    assert call.status == (0, "") and gw.in_flight == {}


async def test_a_held_request_is_checked_again_against_its_keys_scope(tmp_path: Path) -> None:
    """The alias a held request named moves to a model outside its key's scope: 404, not routed."""
    keys = tmp_path / "keys"
    keys.write_text("mine waiting\n")
    gw = Gateway(Settings(), ApiKeys(keys))
    gw.set_routes([route("waiting", names=("w",)), route("other", "10.0.0.8:8000")])
    proc = Processor(gw)
    exchange, cold = decide(proc, headers("/v1/x", **{"x-model-id": "w", "authorization": "Bearer mine"}))
    assert isinstance(cold, Cold)
    held = asyncio.create_task(proc.hold(exchange, cold, exchange.started + 5))
    await asyncio.sleep(0.01)
    gw.set_routes([route("waiting", "10.0.0.9:8000"), route("other", "10.0.0.8:8000", names=("w",))])
    status, _, payload = immediate(await asyncio.wait_for(held, 2))
    assert status == 404 and payload["error"]["code"] == "model_not_found"
    assert gw.in_flight == {}


def test_an_adapter_named_in_the_headers_has_its_body_read_and_rewritten() -> None:
    lora = route("base", "10.0.0.9:8000", served="org/base", strategy="round-robin")
    lora.adapters.add(name="sql", names=["sql"], served_name="sql", lora_id=0, scale=0.5)
    gw = gateway()
    gw.set_routes([*ROUTES, lora])
    proc = Processor(gw)
    exchange = Exchange()
    asked = proc.decide(exchange, headers("/v1/completions", **{"x-model-id": "sql"}))
    assert asked.mode_override.request_body_mode == processing_mode_pb2.ProcessingMode.BUFFERED
    done = proc.decide(exchange, body({"model": "whatever", "prompt": "hi"}))
    assert done.WhichOneof("response") == "request_body"
    common = done.request_body.response
    sent = json.loads(common.body_mutation.body)
    assert sent == {"model": "org/base", "prompt": "hi", "lora": [{"id": 0, "scale": 0.5}]}
    assert set_headers(common)[contract.CLUSTER_HEADER] == "model.base"
    # A request without a body is routed from its headers as before.
    _, bodiless = decide(proc, headers("/v1/completions", end=True, **{"x-model-id": "sql"}))
    assert bodiless.WhichOneof("response") == "request_headers"


async def test_status_path_reports_readiness_and_held_requests_in_the_keys_scope(tmp_path: Path) -> None:
    _, proc = scoped(tmp_path)
    status_of = headers(contract.STATUS_PATH, method="GET", end=True, authorization="Bearer mine")
    exchange, cold = decide(proc, headers("/v1/x", **{"x-model-id": "waiting", "authorization": "Bearer mine"}))
    held = asyncio.create_task(proc.hold(exchange, cold, exchange.started + 5))
    await asyncio.sleep(0.01)
    status, _, payload = immediate(decide(proc, status_of)[1])
    by_model = {m["model"]: m for m in payload["models"]}
    assert status == 200 and payload["synced"] is True
    assert set(by_model) == {"chat", "waiting"}  # the key's scope, as /v1/models
    assert by_model["chat"]["ready_endpoints"] == 2 and by_model["chat"]["names"] == ["chat", "small"]
    assert (by_model["waiting"]["ready_endpoints"], by_model["waiting"]["queued"]) == (0, 1)
    held.cancel()
    refused = immediate(decide(proc, headers(contract.STATUS_PATH, method="GET", end=True))[1])
    assert refused[0] == 401 and refused[2]["error"]["code"] == "invalid_api_key"


def test_fallback_endpoints_follow_the_pick_in_the_destination() -> None:
    fallback = route("chat", "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")
    fallback.fallback_endpoints = 1
    gw = Gateway(Settings(), ApiKeys(None))
    gw.set_routes([fallback])
    decided = decide(Processor(gw), headers("/v1/x", **{"x-model-id": "chat"}))[1]
    destination = set_headers(decided.request_headers.response)[contract.DESTINATION_HEADER].split(",")
    assert len(destination) == 2 and len(set(destination)) == 2
    assert set(destination) <= {"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}
    lb = decided.dynamic_metadata.fields[contract.LB_METADATA_NAMESPACE].struct_value
    assert lb.fields[contract.DESTINATION_HEADER].string_value == ",".join(destination)
    assert gw.in_flight == {"chat": 1}  # one request, counted once on its pick
