"""llama-server (built from the pinned llama.cpp tree) serving the generated model."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from tests.engines.conftest import EngineProcess, TinyFiles, greedy, start_llama_server


def metrics(server: EngineProcess) -> dict[str, float]:
    """The `llamacpp:*` samples of /metrics (these series carry no labels)."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith("llamacpp:"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_greedy_output_is_decided_by_the_model_seed(llama_server_bin: Path, tiny: TinyFiles) -> None:
    first = start_llama_server(llama_server_bin, tiny.model)
    try:
        reply = greedy(first, max_tokens=16)
        assert greedy(first, max_tokens=16) == reply
    finally:
        first.stop()
    again = start_llama_server(llama_server_bin, tiny.model)
    other = start_llama_server(llama_server_bin, tiny.other_seed)
    try:
        assert greedy(again, max_tokens=16) == reply
        assert greedy(other, max_tokens=16) != reply
    finally:
        again.stop()
        other.stop()


def test_metrics_count_the_tokens_of_a_request(llama_server: EngineProcess) -> None:
    before = metrics(llama_server)
    assert {
        "llamacpp:prompt_tokens_total",
        "llamacpp:prompt_tokens_cached_total",
        "llamacpp:tokens_predicted_total",
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        "llamacpp:n_decode_total",
    } <= before.keys()
    greedy(llama_server, max_tokens=5, cache_prompt=False)
    after = metrics(llama_server)
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] == 5
    assert after["llamacpp:prompt_tokens_total"] > before["llamacpp:prompt_tokens_total"]
    assert after["llamacpp:requests_processing"] == 0
    # The same prompt again is served from the prompt cache, and the metrics say so.
    greedy(llama_server, max_tokens=5)
    greedy(llama_server, max_tokens=5)
    assert metrics(llama_server)["llamacpp:prompt_tokens_cached_total"] > after["llamacpp:prompt_tokens_cached_total"]


def test_lora_applied_per_request_changes_greedy_output(
    llama_server: EngineProcess, llama_server_bin: Path, tiny: TinyFiles
) -> None:
    server = start_llama_server(llama_server_bin, tiny.model, "--lora", str(tiny.lora))
    try:
        adapters = server.get_json("/lora-adapters")
        assert [(a["id"], Path(a["path"]).name) for a in adapters] == [(0, tiny.lora.name)]
        base = greedy(server, max_tokens=12, lora=[{"id": 0, "scale": 0.0}])
        adapted = greedy(server, max_tokens=12, lora=[{"id": 0, "scale": 1.0}])
        assert adapted != base
        assert greedy(server, max_tokens=12, lora=[{"id": 0, "scale": 0.0}]) == base
        assert greedy(server, max_tokens=12, lora=[{"id": 0, "scale": 1.0}]) == adapted
    finally:
        server.stop()
    # Scale 0 is the model without the adapter, as a server that never loaded it answers.
    assert greedy(llama_server, max_tokens=12) == base


def test_health_models_and_stop(llama_server_bin: Path, tiny: TinyFiles) -> None:
    server = start_llama_server(llama_server_bin, tiny.model, alias="tiny-alias")
    try:
        assert server.get_json("/health") == {"status": "ok"}
        assert [m["id"] for m in server.get_json("/v1/models")["data"]] == ["tiny-alias"]
    finally:
        assert server.stop() == 0
