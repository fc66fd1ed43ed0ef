"""Model name cascade and name resolution."""

from __future__ import annotations

import json

import pytest

from wakegate.extproc.naming import (
    MAX_JSON_DEPTH,
    BadRequest,
    RouteTable,
    model_from_headers,
    model_from_json,
    model_from_multipart,
    nested_deeper_than,
    parse_json_body,
    rewritten,
)
from wakegate.v1 import routing_pb2


def test_header_beats_path() -> None:
    found = model_from_headers({"x-model-id": "a", ":path": "/model/b/v1/chat/completions"})
    assert found.model == "a" and found.new_path is None


def test_path_prefix_is_stripped() -> None:
    found = model_from_headers({":path": "/model/org%2Fm/v1/chat/completions?x=1"})
    assert found.model == "org/m" and found.new_path == "/v1/chat/completions?x=1"


def test_no_model_in_headers_means_read_the_body() -> None:
    assert model_from_headers({":path": "/v1/chat/completions"}).model is None


@pytest.mark.parametrize("path", ["/model/", "/model/x", "/model//v1"])
def test_bad_prefix(path: str) -> None:
    with pytest.raises(BadRequest):
        model_from_headers({":path": path})


@pytest.mark.parametrize("body", [b"", b"{", b"[]", b"null", b'"x"'])
def test_bad_json(body: bytes) -> None:
    with pytest.raises(BadRequest):
        parse_json_body(body)


@pytest.mark.parametrize("value", [None, 3, "", " a b ", "x" * 300])
def test_bad_model_values(value: object) -> None:
    with pytest.raises(BadRequest):
        model_from_json({"model": value} if value is not None else {})


def test_multipart() -> None:
    body = (
        b'--B\r\nContent-Disposition: form-data; name="file"; filename="m"\r\n\r\nmodel\r\n'
        b'--B\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper\r\n--B--\r\n'
    )
    assert model_from_multipart("multipart/form-data; boundary=B", body) == "whisper"
    with pytest.raises(BadRequest, match="no `model`"):
        model_from_multipart("multipart/form-data; boundary=B", b"--B\r\n\r\n--B--")
    with pytest.raises(BadRequest, match="boundary"):
        model_from_multipart("multipart/form-data", body)


def test_route_table_resolves_names_aliases_and_adapters() -> None:
    route = routing_pb2.ModelRoute(
        key="m", names=["m", "alias"], served_name="org/m", lora_adapters=["sql"], cluster="model.m"
    )
    table = RouteTable([route])
    assert table.resolve("alias").body_model == "org/m"  # type: ignore[union-attr]
    assert table.resolve("org/m").body_model == "org/m"  # type: ignore[union-attr]
    assert table.resolve("sql").body_model == "sql"  # type: ignore[union-attr]
    assert table.resolve("nope") is None
    listing = {entry["id"]: entry for entry in table.listing()}
    assert set(listing) == {"m", "alias", "org/m", "sql"}
    assert listing["sql"]["parent"] == "org/m"


def nested(depth: int) -> bytes:
    """A body whose deepest array sits `depth` levels down (the object itself is level 1)."""
    return b'{"model": "a", "x": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


def test_nesting_up_to_the_limit_is_accepted_and_past_it_refused() -> None:
    assert parse_json_body(nested(MAX_JSON_DEPTH))["model"] == "a"
    with pytest.raises(BadRequest) as refused:
        parse_json_body(nested(MAX_JSON_DEPTH + 1))
    assert refused.value.code == "json_too_deep"


@pytest.mark.parametrize("depth", [1_000, 5_000, 100_000])
def test_nesting_past_what_the_parser_survives_is_the_same_refusal(depth: int) -> None:
    with pytest.raises(BadRequest) as refused:
        parse_json_body(nested(depth))
    assert refused.value.code == "json_too_deep"


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    text = "[" * 500 + '\\"{' * 300 + "\\\\" + "}" * 10
    body = json.dumps({"model": "a", "messages": [{"role": "user", "content": text}], "k": '"[[['}).encode()
    assert parse_json_body(body)["messages"][0]["content"] == text


@pytest.mark.parametrize(
    "value",
    [
        {"model": "a"},
        [[[]], [], {"a": [1, {"b": "]]]]"}]}],
        {"s": 'a\\"[[[\\\\', "t": ["x\\\\"], "u": {}},
        ["\\", "\\\\\\", '"', "[{", "}]", [[[[[[[]]]]]]]],
        [list(range(1000)), {"k": [{"k": [{}]}]}],
    ],
)
def test_nesting_is_measured_on_the_structure(value: dict[str, object] | list[object]) -> None:
    def depth(v: object) -> int:
        if isinstance(v, dict):
            return 1 + max(map(depth, v.values()), default=0)
        if isinstance(v, list):
            return 1 + max(map(depth, v), default=0)
        return 0

    for limit in range(1, 10):
        assert nested_deeper_than(value, limit) == (depth(value) > limit), limit


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "a", "model": "b"}',
        b'{"model": "a", "messages": [], "m\\u006fdel": "b"}',
        b'{"\\u006D\\u006f\\u0064\\u0065\\u006C": "a", "model": "a"}',
    ],
)
def test_two_model_keys_are_refused(body: bytes) -> None:
    with pytest.raises(BadRequest) as refused:
        parse_json_body(body)
    assert refused.value.code == "duplicate_model"


def test_model_named_again_below_the_top_level_is_fine() -> None:
    body = b'{"model": "a", "tools": [{"model": "x", "model": "y"}], "note": "\\"model\\""}'
    assert parse_json_body(body)["model"] == "a"


@pytest.mark.parametrize("body", [b'{"model": "a\xff"}', b'{"model": "\xed\xa0\x80"}', b"\xff\xfe{\x00}\x00"])
def test_a_body_that_is_not_utf8_is_refused(body: bytes) -> None:
    with pytest.raises(BadRequest) as refused:
        parse_json_body(body)
    assert refused.value.code == "invalid_json"


def test_a_utf8_byte_order_mark_is_accepted() -> None:
    assert parse_json_body(b'\xef\xbb\xbf{"model": "a"}')["model"] == "a"


def test_rewrite_sets_the_model_and_keeps_the_rest() -> None:
    parsed = parse_json_body('{"model": "a", "messages": [{"content": "héllo \\ud83d\\ude00"}]}'.encode())
    assert json.loads(rewritten(parsed, "org/a")) == {"model": "org/a", "messages": [{"content": "héllo 😀"}]}


@pytest.mark.parametrize("escape", ["\\ud800", "\\udfff", "x\\ud83dy", "\\ude00\\ud83d"])
def test_rewrite_refuses_a_lone_surrogate(escape: str) -> None:
    parsed = parse_json_body(f'{{"model": "a", "messages": [{{"content": "{escape}"}}]}}'.encode())
    with pytest.raises(BadRequest) as refused:
        rewritten(parsed, "org/a")
    assert refused.value.code == "invalid_unicode"


def form(*parts: bytes) -> bytes:
    return b"".join(b"--B\r\n" + part + b"\r\n" for part in parts) + b"--B--\r\n"


def test_multipart_model_that_is_not_utf8_is_refused() -> None:
    body = form(b'Content-Disposition: form-data; name="model"\r\n\r\nwhis\xffper')
    with pytest.raises(BadRequest) as refused:
        model_from_multipart("multipart/form-data; boundary=B", body)
    assert refused.value.code == "invalid_model"


def test_multipart_with_two_model_fields_is_refused() -> None:
    one = b'Content-Disposition: form-data; name="model"\r\n\r\na'
    two = b"Content-Disposition: form-data; name=model\r\n\r\nb"
    with pytest.raises(BadRequest) as refused:
        model_from_multipart("multipart/form-data; boundary=B", form(one, two))
    assert refused.value.code == "duplicate_model"


def test_multipart_boundary_outside_latin1_is_read_as_utf8() -> None:
    body = b'--\xc3\xa9\r\nContent-Disposition: form-data; name="model"\r\n\r\nw\r\n--\xc3\xa9--\r\n'
    assert model_from_multipart("multipart/form-data; boundary=é", body) == "w"
    with pytest.raises(BadRequest):
        model_from_multipart("multipart/form-data; boundary=\ufffd", body)


def adapter_route(*, llama: bool) -> routing_pb2.ModelRoute:
    """A base `m` (served as org/m) with two LoRAAdapter objects; llama.cpp style names them by id."""
    ids = {"lora_id": 0}, {"lora_id": 1}
    return routing_pb2.ModelRoute(
        key="m",
        names=["m"],
        served_name="org/m",
        cluster="model.m",
        adapters=[
            routing_pb2.LoRAAdapterRoute(
                name="sql",
                names=["sql", "tiny-sql", "sql-v1"],
                served_name="tiny-sql",
                scale=0.5,
                **(ids[0] if llama else {}),
            ),
            routing_pb2.LoRAAdapterRoute(
                name="poet", names=["poet"], served_name="poet", scale=1.0, **(ids[1] if llama else {})
            ),
        ],
    )


def test_llama_adapters_keep_the_base_name_and_get_their_lora_entry() -> None:
    table = RouteTable([adapter_route(llama=True)])
    for name in ("sql", "tiny-sql", "sql-v1"):
        sql = table.resolve(name)
        assert sql is not None and (sql.body_model, sql.adapter, sql.lora) == ("org/m", "tiny-sql", (0, 0.5))
    parsed = {"model": "sql", "lora": [{"id": 1, "scale": 9}], "messages": []}
    assert sql.needs_rewrite(parsed)
    assert json.loads(sql.rewrite(parsed)) == {"model": "org/m", "lora": [{"id": 0, "scale": 0.5}], "messages": []}
    assert not sql.needs_rewrite(json.loads(sql.rewrite(parsed)))
    poet = table.resolve("poet")
    assert poet is not None and poet.lora == (1, 1.0)
    # The base itself names a zero-scale list, so the engine drops a prompt cache made with an adapter.
    base = table.resolve("m")
    assert base is not None and base.adapter is None and base.needs_body
    assert json.loads(base.rewrite({"model": "m"})) == {"model": "org/m", "lora": [{"id": 0, "scale": 0.0}]}


def test_vllm_adapters_are_named_as_the_model() -> None:
    table = RouteTable([adapter_route(llama=False)])
    sql = table.resolve("sql-v1")
    assert sql is not None and (sql.body_model, sql.adapter, sql.lora, sql.needs_body) == (
        "tiny-sql",
        "tiny-sql",
        None,
        True,
    )
    assert json.loads(sql.rewrite({"model": "sql-v1"})) == {"model": "tiny-sql"}
    base = table.resolve("m")
    assert base is not None and (base.lora, base.needs_body) == (None, False)
    listing = {entry["id"]: entry for entry in table.listing()}
    assert {name: entry.get("parent") for name, entry in listing.items()} == {
        "m": None,
        "org/m": None,
        "sql": "org/m",
        "tiny-sql": "org/m",
        "sql-v1": "org/m",
        "poet": "org/m",
    }
