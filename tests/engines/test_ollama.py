"""Ollama (built from its Go module) serving the generated model, created from the local GGUF."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from tests.engines.conftest import EngineProcess, greedy


def test_created_model_is_listed_with_its_gguf_details(ollama: EngineProcess) -> None:
    models = {m["name"]: m for m in ollama.get_json("/api/tags")["models"]}
    assert {"tiny:latest", "tiny-seed1:latest", "tiny-lora:latest"} <= models.keys()
    details = models["tiny:latest"]["details"]
    assert (details["format"], details["family"]) == ("gguf", "llama")


def test_greedy_output_is_decided_by_the_model_seed(ollama: EngineProcess) -> None:
    first = greedy(ollama, max_tokens=16)
    assert greedy(ollama, max_tokens=16) == first
    assert greedy(ollama, max_tokens=16, model="tiny-seed1") != first
    assert greedy(ollama, max_tokens=16) == first


def test_adapter_in_the_modelfile_changes_greedy_output(ollama: EngineProcess) -> None:
    base = greedy(ollama, max_tokens=12)
    adapted = greedy(ollama, max_tokens=12, model="tiny-lora")
    assert adapted != base
    assert greedy(ollama, max_tokens=12) == base


def test_loaded_model_never_unloads_by_itself(ollama: EngineProcess) -> None:
    greedy(ollama, max_tokens=1)
    loaded = {m["name"]: m for m in ollama.get_json("/api/ps")["models"]}
    assert "tiny:latest" in loaded
    # OLLAMA_KEEP_ALIVE=-1: the expiry lies centuries ahead; wakegate, not Ollama, decides idling.
    expires = datetime.fromisoformat(loaded["tiny:latest"]["expires_at"])
    assert expires - datetime.now(UTC) > timedelta(days=365 * 100)
