"""Backend plugins: command lines checked against each engine's documented flags, load signals,
images that claim only what they are built for, and Models refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from wakegate.control.backends import BACKENDS, BackendError, LoadSignals
from wakegate.control.manifests import ManifestError, parse_models

VALUES = {"host": "127.0.0.1", "port": "9001", "model": "/m/tiny.gguf", "served_name": "org/tiny", "state": "/s"}

#: Each engine's documented command-line surface that wakegate relies on: the subcommand, the
#: positional model (if any) and the flags (each taking one value unless listed in `switches`).
#: Sources: `llama-server --help` (the tests in tests/engines run the real one), `vllm serve
#: --help` and vLLM's OpenAI server docs, vLLM-Omni's serving docs (`--omni`), MLC LLM's REST API
#: docs (`mlc_llm serve MODEL [--host] [--port]`), ComfyUI's startup flags (`--listen`, `--port`).
DOCUMENTED = {
    "llamacpp": {
        "program": ("llama-server",),
        "positional": None,
        "flags": {"--model", "--alias", "--host", "--port"},
        "switches": {"--metrics"},
    },
    "vllm": {
        "program": ("vllm", "serve"),
        "positional": "/m/tiny.gguf",
        "flags": {"--host", "--port", "--served-model-name"},
        "switches": set(),
    },
    "vllm-omni": {
        "program": ("vllm", "serve"),
        "positional": "/m/tiny.gguf",
        "flags": {"--host", "--port", "--served-model-name"},
        "switches": {"--omni"},
    },
    "mlc-llm": {
        "program": ("mlc_llm", "serve"),
        "positional": "/m/tiny.gguf",
        "flags": {"--host", "--port"},
        "switches": set(),
    },
    "ollama": {"program": ("ollama", "serve"), "positional": None, "flags": set(), "switches": set()},
}


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_command_uses_only_documented_flags(name: str) -> None:
    doc = DOCUMENTED[name]
    argv = BACKENDS[name].command(VALUES)
    program = doc["program"]
    assert tuple(argv[: len(program)]) == program
    rest = argv[len(program) :]
    if doc["positional"] is not None:
        assert rest[0] == doc["positional"], "the model comes first, as the engine's CLI documents"
        rest = rest[1:]
    seen: dict[str, str] = {}
    i = 0
    while i < len(rest):
        flag = rest[i]
        assert flag.startswith("--"), f"{name}: stray word {flag!r}"
        if flag in doc["switches"]:
            i += 1
            continue
        assert flag in doc["flags"], f"{name}: {flag} is not a documented flag"
        seen[flag] = rest[i + 1]
        i += 2
    # The engine gets the file and serves the served name; never the Model's own name.
    if "--model" in seen:
        assert seen["--model"] == "/m/tiny.gguf"
    for flag in ("--alias", "--served-model-name"):
        if flag in seen:
            assert seen[flag] == "org/tiny"
    if "--port" in seen:
        assert seen["--port"] == "9001"


def test_ollama_gets_its_own_store_port_and_never_idles() -> None:
    env = BACKENDS["ollama"].environment(VALUES)
    assert env["OLLAMA_HOST"] == "127.0.0.1:9001"
    assert env["OLLAMA_MODELS"] == "/s/models" and env["HOME"] == "/s"
    assert env["OLLAMA_KEEP_ALIVE"] == "-1"
    steps = [(s.method, s.path) for s in BACKENDS["ollama"].prepare]
    assert steps == [("POST", "/api/blobs/sha256:{sha256}"), ("POST", "/api/create")]
    # The model is loaded by its first request, before it is routed; /api/ps must then list it.
    assert BACKENDS["ollama"].load_by_answering and BACKENDS["ollama"].loaded[0].path == "/api/ps"


def test_engines_without_a_standard_command_need_one() -> None:
    for name in ("comfyui", "diffusers"):
        with pytest.raises(BackendError, match=r"spec\.command"):
            BACKENDS[name].command(VALUES)
    argv = BACKENDS["comfyui"].command(VALUES, ("python", "/opt/ComfyUI/main.py"))
    assert argv == ["python", "/opt/ComfyUI/main.py", "--listen", "127.0.0.1", "--port", "9001"]


def test_llama_server_metrics_map_onto_the_load_pair() -> None:
    text = """# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
llamacpp:requests_deferred 3
llamacpp:prompt_tokens_total 120
"""
    assert BACKENDS["llamacpp"].load_metrics.parse(text) == LoadSignals(2, 3, None)  # type: ignore[union-attr]
    assert LoadSignals(2, 3).queue == 5


def test_vllm_metrics_sum_labels_and_read_either_kv_name() -> None:
    text = """vllm:num_requests_running{model_name="a"} 1
vllm:num_requests_running{model_name="b"} 2 1700000000
vllm:num_requests_waiting{model_name="a"} 4
vllm:gpu_cache_usage_perc{model_name="a"} 0.25
"""
    assert BACKENDS["vllm"].load_metrics.parse(text) == LoadSignals(3, 4, 0.25)  # type: ignore[union-attr]
    assert BACKENDS["sim"].load_metrics.parse("garbage\n{}\nx y z\n") is None  # type: ignore[union-attr]


def test_list_backends_says_which_load_signal_each_uses(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from wakegate.control.up import main as up_main

    parser = argparse.ArgumentParser()
    up_main.add_arguments(parser)
    assert up_main.main(parser.parse_args(["--list-backends"])) == 0
    out = capsys.readouterr().out
    blocks = dict(zip(out.splitlines()[::2], out.splitlines()[1::2], strict=True))
    by_name = {head.split()[0]: signal for head, signal in blocks.items()}
    assert "llamacpp:requests_processing + llamacpp:requests_deferred" in by_name["llamacpp"]
    assert "in-flight count (the engine reports no queue)" in by_name["ollama"]
    assert "vllm:num_requests_running" in by_name["vllm"]


def test_images_claim_only_their_vendor() -> None:
    # CUDA builds never claim AMD and back; engines without an official image claim nothing.
    for backend in BACKENDS.values():
        for image in backend.images:
            ref = image.reference
            if "cuda" in ref or ref.startswith("vllm/vllm-openai") or ref.startswith("vllm/vllm-omni"):
                assert image.vendor == "nvidia", ref
            if "rocm" in ref:
                assert image.vendor == "amd", ref
    for name in ("mlc-llm", "comfyui", "diffusers"):
        assert BACKENDS[name].images == () and BACKENDS[name].gpu_vendors == ()
    assert BACKENDS["vllm-omni"].gpu_vendors == ("nvidia",)


MODEL = """apiVersion: wakegate.io/v1alpha1
kind: Model
metadata: {{name: m}}
spec: {{{spec}}}
"""


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("backend: tgi", "unknown backend 'tgi'; known: comfyui, diffusers, llamacpp"),
        ("backend: llamacpp", "loads one GGUF file: set spec.source"),
        ("backend: ollama", "loads one GGUF file: set spec.source"),
        ("backend: comfyui", "has no standard command: set spec.command"),
        ("backend: llamacpp, source: 'ftp://x/y.gguf'", "spec.source"),
    ],
)
def test_models_an_engine_cannot_serve_are_refused_at_load(spec: str, words: str) -> None:
    with pytest.raises(ManifestError, match="document 1") as err:
        parse_models(MODEL.format(spec=spec), "models.yaml")
    assert words in str(err.value)


def test_file_sources_absolute_and_relative_parse() -> None:
    for source in ("file:///srv/tiny.gguf", "file://models/tiny.gguf"):
        (model,) = parse_models(MODEL.format(spec=f"backend: llamacpp, source: '{source}'"))
        assert model.spec.source == source


def test_up_refuses_a_model_it_cannot_start_before_anything_starts(tmp_path: Path) -> None:
    from wakegate.control.up.engine import runnable

    (weights,) = parse_models(MODEL.format(spec="backend: llamacpp, source: 'file://w/tiny.gguf'"))
    assert runnable(weights, tmp_path) == f"spec.source file://w/tiny.gguf: {tmp_path}/w/tiny.gguf does not exist"
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "tiny.gguf").write_bytes(b"GGUF")
    problem = runnable(weights, tmp_path)
    # The file is there now; what is missing is the engine (unless this machine has one on PATH).
    assert problem is None or "'llama-server' is not an executable on PATH" in problem
    (absolute,) = parse_models(MODEL.format(spec=f"backend: sim, source: 'file://{tmp_path}/w'"))
    assert runnable(absolute, Path("/nonexistent")) is None
    (comfy,) = parse_models(MODEL.format(spec="backend: comfyui, command: [/no/such/python, main.py]"))
    assert "'/no/such/python' is not an executable on PATH" in (runnable(comfy, tmp_path) or "")


def test_wakegate_up_says_which_model_cannot_start_and_exits_2(tmp_path: Path) -> None:
    import subprocess
    import sys

    manifest = tmp_path / "models.yaml"
    manifest.write_text(MODEL.format(spec="backend: llamacpp, source: 'file://missing.gguf'"))
    out = subprocess.run(
        [sys.executable, "-m", "wakegate", "up", "--check", "-f", str(manifest)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"wakegate up: {manifest}: Model 'm': spec.source file://missing.gguf: {tmp_path}/missing.gguf does not exist"
    ]
    assert "Traceback" not in out.stderr
