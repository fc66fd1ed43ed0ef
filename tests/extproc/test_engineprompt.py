"""Precise scoring on real vLLM: the gateway's token ids and block hashes for a prompt are the
engine's (its tokenizer, its chat template, its block size), so the precise scorer credits the
endpoint whose engine holds the prompt's blocks. Checked here against a generated Hugging Face
model folder; tests/engines/test_up_vllm.py checks the same ids against a running vLLM's events."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from e2e.hfmodel import write_model
from wakegate.extproc.engineprompt import EnginePrompt, PromptError
from wakegate.extproc.picking import Picker
from wakegate.kvevents import Stored, vllm_block_hashes
from wakegate.v1 import routing_pb2

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("hf") / "tiny")


def chat(*contents: str) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": c} for c in contents]}


def test_a_chat_is_rendered_by_the_models_template_and_tokenized_without_extra_specials(folder: Path) -> None:
    prompt = EnginePrompt(folder)
    text = prompt.chat_text(chat("tell me about the weather"))
    assert text == "<|im_start|>user\ntell me about the weather<|im_end|>\n<|im_start|>assistant\n"
    ids = prompt.token_ids(chat("tell me about the weather"))
    assert ids is not None and len(ids) < len(text)  # BPE merges: fewer ids than characters
    vocab = json.loads((folder / "tokenizer.json").read_text())
    specials = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    # The template's own markers are single special tokens, none added in front of them.
    assert ids[0] == specials["<|im_start|>"] and ids.count(specials["<|im_end|>"]) == 1
    # Text parts of a content list are one message, joined by newlines (as vLLM joins them).
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert prompt.chat_text({"messages": [parts]}) == prompt.chat_text(chat("a\nb"))


def test_prompts_the_gateway_cannot_render_exactly_get_no_ids(folder: Path) -> None:
    prompt = EnginePrompt(folder)
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
    for body in (
        {"messages": [image]},
        {**chat("x"), "tools": [{"type": "function", "function": {"name": "f"}}]},
        {**chat("x"), "chat_template": "{{ 'other' }}"},
        {**chat("x"), "continue_final_message": True},
        {"messages": [{"content": "no role"}]},
        {"messages": []},
        {"prompt": [1, "two"]},
        None,
    ):
        assert prompt.token_ids(body) is None, body
    assert prompt.token_ids({"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert prompt.token_ids({"prompt": "the sea"})


def test_a_folder_without_a_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(PromptError, match=r"tokenizer\.json"):
        EnginePrompt(tmp_path)


def test_training_markers_in_a_template_render_their_body(folder: Path, tmp_path: Path) -> None:
    copy = tmp_path / "m"
    copy.mkdir()
    (copy / "tokenizer.json").write_text((folder / "tokenizer.json").read_text())
    template = "{% for m in messages %}{% generation %}[{{ m['content'] }}]{% endgeneration %}{% endfor %}"
    (copy / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    assert EnginePrompt(copy).chat_text(chat("x", "y")) == "[x][y]"


def route(folder: Path | str) -> routing_pb2.ModelRoute:
    eps = [routing_pb2.Endpoint(address=e.split(":")[0], port=8000) for e in (A, B)]
    return routing_pb2.ModelRoute(key="m", endpoints=eps, profile="precise", kv_events_offset=1, tokenizer=str(folder))


def test_the_picker_credits_the_engine_holding_the_prompts_token_blocks(folder: Path) -> None:
    picker = Picker()
    picker.configure([route(folder)])
    system = "the weather today is sunny and warm " * 30
    ids = EnginePrompt(folder).token_ids(chat(system))
    assert ids is not None and len(ids) >= 64
    # B's engine (blocks of 16 tokens) stored the prompt's blocks, named by vLLM's chain.
    picker.kv.apply(B, 0, [Stored(tuple(vllm_block_hashes(ids, 16)), block_size=16)])
    for question in ("q1", "q2", "q3", "q4"):
        body = {"model": "m", "messages": [{"role": "user", "content": system}, {"role": "user", "content": question}]}
        assert picker.pick("m", "default", [A, B], {}, body) == B
        assert picker.last is not None and picker.last.scores[B] > picker.last.scores[A]
    # An adapter request's blocks carry the adapter's key on the engine: no precise credit.
    adapter = {**chat(system), "model": "m"}
    picker.pick("m", "default", [A, B], {}, adapter, adapter="sql")
    assert picker.last is not None and picker.last.scores[A] == picker.last.scores[B]


def test_a_route_whose_tokenizer_cannot_load_is_scored_without_precise_credit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    picker = Picker()
    picker.configure([route(tmp_path / "gone")])
    picker.kv.apply(B, 0, [Stored((1, 2, 3), block_size=16)])
    for _ in range(3):
        assert picker.pick("m", "default", [A, B], {}, chat("x " * 100)) in (A, B)
    warned = [r.getMessage() for r in caplog.records if "precise scoring without a tokenizer" in r.getMessage()]
    assert len(warned) == 1 and "tokenizer.json" in warned[0]  # once, naming what is missing


def test_tokenizing_piece_by_piece_gives_the_ids_of_the_whole(folder: Path) -> None:
    """Pieces between special tokens are tokenized once and kept: a shared system prompt is paid
    for by its first request only, and the ids are exactly those of encoding the whole text."""
    prompt = EnginePrompt(folder)
    whole = prompt._tokenizer
    texts = [
        "<|im_start|>user\nhello  there<|im_end|>\n<|im_start|>assistant\n",
        "no specials at all, just words: the sea, the mountains",
        "<|im_end|><|im_end|>x<|im_start|>",
        " leading space<|im_start|> trailing space ",
        "üñí©ødé ☃ <|im_start|>\n\n\tmixed",
    ]
    for text in texts:
        assert prompt._encode(text) == whole.encode(text, add_special_tokens=False).ids, text
    system = {"role": "system", "content": "the weather today is sunny and warm " * 50}
    prompt.hits = prompt.misses = 0
    for q in range(5):
        prompt.token_ids({"messages": [system, {"role": "user", "content": f"question {q}"}]})
    assert prompt.hits >= 4  # the system prompt's piece, tokenized once
