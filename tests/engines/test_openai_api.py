"""Both engines answer the official openai client: tokens the engine produced, with usage counts."""

from __future__ import annotations

import pytest

from tests.engines.conftest import EngineProcess, chat


@pytest.fixture(params=["llama_server", "ollama"])
def engine(request: pytest.FixtureRequest) -> EngineProcess:
    server: EngineProcess = request.getfixturevalue(request.param)
    return server


def test_chat_completion_produces_the_requested_tokens(engine: EngineProcess) -> None:
    reply = chat(engine, max_tokens=8)
    assert reply.model == "tiny"
    assert reply.text
    # The generated model never predicts an end token, so a reply is exactly max_tokens long.
    assert reply.finish_reason == "length"
    assert reply.usage is not None
    assert reply.usage.prompt_tokens > 0
    assert reply.usage.completion_tokens == 8


def test_streaming_sends_the_same_text_in_several_chunks(engine: EngineProcess) -> None:
    streamed = chat(engine, max_tokens=8, stream=True)
    assert streamed.pieces > 1
    assert streamed.text == chat(engine, max_tokens=8).text
    assert streamed.finish_reason == "length"
    assert streamed.usage is not None
    assert streamed.usage.prompt_tokens > 0
    assert streamed.usage.completion_tokens == 8
