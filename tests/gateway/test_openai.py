"""The official openai client against the real gateway, on the decided and the native path
(`chat-n` is routed by Envoy alone; `test_the_native_models_requests_open_no_ext_proc_stream`
checks that it really is)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.gateway.conftest import API_KEY, NATIVE, extproc_streams, routing_path
from tests.support.http import request
from tests.support.up import UpProcess


@pytest.fixture
def client(gateway: UpProcess) -> Iterator[openai.OpenAI]:
    # Closed after each test: a pooled connection left to the collector is a ResourceWarning.
    with openai.OpenAI(base_url=gateway.base_url, api_key=API_KEY, max_retries=0) as opened:
        yield opened


@pytest.mark.parametrize("model", ["chat-a", "a", "gpt-a", "chat-b", "b", NATIVE, "n", "gpt-n"])
def test_chat_completion_non_streaming(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello there"}], max_tokens=5
    )
    assert reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 5


@pytest.mark.parametrize("model", ["chat-a", "chat-b", NATIVE, "gpt-n"])
def test_chat_completion_streaming(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "stream please"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert len(pieces) == 6
    assert usage is not None and usage.completion_tokens == 6


def test_alias_is_rewritten_to_served_name(client: openai.OpenAI) -> None:
    # The backend only serves org/chat-a; it would answer 404 for the alias.
    reply = client.chat.completions.create(model="gpt-a", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert reply.model == "org/chat-a"


def test_models_lists_every_name_and_alias(client: openai.OpenAI) -> None:
    ids = {m.id for m in client.models.list()}
    assert {
        "chat-a",
        "org/chat-a",
        "a",
        "gpt-a",
        "a-sql",
        "chat-b",
        "b",
        "chat-p",
        "chat-l",
        "chat-r",
        "chat-cold",
        NATIVE,
        "n",
        "gpt-n",
    } <= ids


@pytest.mark.parametrize(("name", "root"), [("a", "org/chat-a"), ("org/chat-a", "org/chat-a"), ("a-sql", "org/chat-a")])
def test_models_retrieve_answers_for_every_listed_name(client: openai.OpenAI, name: str, root: str) -> None:
    found = client.models.retrieve(name)
    assert found.id == name
    assert found.model_dump()["root"] == root


def test_models_retrieve_of_an_unknown_model_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.status_code == 404
    assert err.value.body == {
        "message": "model 'no-such-model' does not exist",
        "type": "not_found_error",
        "code": "model_not_found",
    }


@pytest.mark.parametrize(("completing", "embedding"), [("a", "chat-b"), ("n", "gpt-n")])
def test_completions_and_embeddings(client: openai.OpenAI, completing: str, embedding: str) -> None:
    done = client.completions.create(model=completing, prompt="once upon", max_tokens=3)
    assert done.choices[0].text
    emb = client.embeddings.create(model=embedding, input=["one", "two"])
    assert len(emb.data) == 2


def test_model_from_header_and_path(gateway: UpProcess) -> None:
    headers = {"authorization": f"Bearer {API_KEY}"}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "model": "org/chat-a"}
    by_header = request("POST", f"{gateway.url}/v1/chat/completions", body=body, headers={**headers, "x-model-id": "a"})
    assert by_header.status == 200, by_header.text
    by_path = request(
        "POST",
        f"{gateway.url}/model/chat-b/v1/chat/completions",
        body={**body, "model": "chat-b"},
        headers=headers,
    )
    assert by_path.status == 200, by_path.text
    assert by_path.json()["model"] == "chat-b"


def test_native_model_from_header_and_path(gateway: UpProcess) -> None:
    headers = {"authorization": f"Bearer {API_KEY}"}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    by_header = request("POST", f"{gateway.url}/v1/chat/completions", body=body, headers={**headers, "x-model-id": "n"})
    assert by_header.status == 200, by_header.text
    by_path = request("POST", f"{gateway.url}/model/{NATIVE}/v1/chat/completions", body=body, headers=headers)
    assert by_path.status == 200, by_path.text
    for reply in (by_header, by_path):
        assert reply.headers["x-wakegate-upstream"] in set(gateway.endpoints(NATIVE))


def test_the_native_models_requests_open_no_ext_proc_stream(gateway: UpProcess) -> None:
    """What makes the tests above cover both paths: chat-n's requests are routed by Envoy alone
    by its name in the body and by any of its names in the header or path, while a decided
    model's each open an ext_proc stream. An alias in the body is decided on purpose: the engine
    serves only `chat-n`, and only extproc can rewrite the body's `model` (docs/decisions.md)."""
    assert routing_path(gateway, NATIVE) == "native" and routing_path(gateway, "chat-o") == "decided"
    auth = {"authorization": f"Bearer {API_KEY}"}
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}
    url = f"{gateway.url}/v1/chat/completions"

    def streams_opened(name: str, way: str) -> int:
        before = extproc_streams(gateway)
        if way == "body":
            reply = request("POST", url, body={**chat, "model": name}, headers=auth)
        elif way == "header":
            reply = request("POST", url, body=chat, headers={**auth, "x-model-id": name})
        else:
            reply = request("POST", f"{gateway.url}/model/{name}/v1/chat/completions", body=chat, headers=auth)
        assert reply.status == 200, reply.text
        return extproc_streams(gateway) - before

    for name in (NATIVE, "n", "gpt-n"):
        assert streams_opened(name, "header") == streams_opened(name, "path") == 0, name
    assert streams_opened(NATIVE, "body") == 0
    assert streams_opened("n", "body") == streams_opened("gpt-n", "body") == 1  # the rewrite
    assert streams_opened("chat-o", "body") == streams_opened("chat-o", "header") == 1
