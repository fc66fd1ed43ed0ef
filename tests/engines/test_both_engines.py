"""llama-server and Ollama run the same llama.cpp kernels: on the same generated file, with the
same prompt format (Ollama maps the GGUF's ChatML template to its own), greedy replies agree
token for token, with and without the LoRA adapter. This shows each engine loaded the file,
tokenizer and adapter as written, not just that it produced some text."""

from __future__ import annotations

from pathlib import Path

from tests.engines.conftest import EngineProcess, TinyFiles, greedy, start_llama_server


def test_engines_agree_on_greedy_output(llama_server: EngineProcess, ollama: EngineProcess) -> None:
    assert greedy(ollama, max_tokens=12) == greedy(llama_server, max_tokens=12)


def test_engines_agree_on_the_adapted_output(llama_server_bin: Path, tiny: TinyFiles, ollama: EngineProcess) -> None:
    server = start_llama_server(llama_server_bin, tiny.model, "--lora", str(tiny.lora))
    try:
        adapted = greedy(server, max_tokens=12, lora=[{"id": 0, "scale": 1.0}])
    finally:
        server.stop()
    assert greedy(ollama, max_tokens=12, model="tiny-lora") == adapted
