"""Model name cascade and name resolution."""

from __future__ import annotations

import pytest

from wakegate.extproc.naming import (
    BadRequest,
    RouteTable,
    model_from_headers,
    model_from_json,
    model_from_multipart,
    parse_json_body,
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
