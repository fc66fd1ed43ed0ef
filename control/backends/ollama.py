"""Ollama: one `ollama serve` per replica, the model created from the GGUF before it is routable.

- Start: `ollama serve` with its own `OLLAMA_HOST` (port), `OLLAMA_MODELS` and `HOME` (under the
  replica's private folder), `OLLAMA_KEEP_ALIVE=-1` so Ollama never unloads the model on its own
  (wakegate owns idling), no cloud features, one loaded model.
- Load: the GGUF is uploaded as a blob (`POST /api/blobs/sha256:…`; Ollama keeps a copy), the
  model created from it under the served name (`POST /api/create`), then loaded by asking it for
  one token (Ollama loads a model on its first request; `OLLAMA_KEEP_ALIVE=-1` keeps it). Ready =
  that answer came and `/api/ps` lists the model.
- Load signal: Ollama has no metrics endpoint and reports no queue or in-flight counts. Picking
  uses the gateway's own in-flight count per replica; `/api/ps` (the model is loaded) is the
  health check while the replica is ready; draining waits for the gateway's in-flight count.
- Stop: SIGTERM closes the server at once, so wakegate drains first.
- In a pod (no wakegate beside it), a shell wrapper starts `ollama serve`, waits for it, and
  creates the model with `ollama create` from a Modelfile naming the GGUF; the kubelet's probe is
  `/v1/models/NAME` (404 until created). `OLLAMA_KEEP_ALIVE=-1` keeps the model loaded once the
  first request has loaded it.
"""

from __future__ import annotations

from wakegate.control.backends.base import Backend, HttpStep, Image

#: `sh -c` script for a pod: $1 is the GGUF, $2 the served name.
POD_SCRIPT = (
    'mkdir -p "$HOME" && ollama serve & server=$!; '
    "until ollama list >/dev/null 2>&1; do sleep 0.2; done; "
    'printf "FROM %s\\n" "$1" > "$HOME/Modelfile" && ollama create "$2" -f "$HOME/Modelfile" || exit 1; '
    'wait "$server"'
)

OLLAMA = Backend(
    name="ollama",
    description="Ollama (one `ollama serve` per replica; the model created from a GGUF file)",
    program=("ollama", "serve"),
    args=(),
    default_port=11434,
    health_path="/api/version",
    images=(
        Image("cpu", "ollama/ollama:latest"),
        Image("nvidia", "ollama/ollama:latest", suffix="cuda"),
        Image("amd", "ollama/ollama:rocm", suffix="rocm"),
    ),
    env={
        "OLLAMA_HOST": "{host}:{port}",
        "OLLAMA_MODELS": "{state}/models",
        "HOME": "{state}",
        "OLLAMA_KEEP_ALIVE": "-1",
        "OLLAMA_NO_CLOUD": "1",
        "OLLAMA_MAX_LOADED_MODELS": "1",
    },
    prepare=(
        HttpStep("POST", "/api/blobs/sha256:{sha256}", upload_model=True, what="upload the GGUF"),
        HttpStep(
            "POST",
            "/api/create",
            body={"model": "{served_name}", "files": {"model.gguf": "sha256:{sha256}"}, "stream": False},
            what="create the model",
        ),
    ),
    loaded=(HttpStep("GET", "/api/ps", contains='"name":"{served_name}', what="the model is loaded", timeout=5),),
    answer_probe=True,
    load_by_answering=True,
    # Asleep: the model unloaded from the running server (`keep_alive: 0` on a request without a
    # prompt), reloaded by the same request with `keep_alive: -1`; no process start, no create.
    sleep=(
        HttpStep("POST", "/api/generate", body={"model": "{served_name}", "keep_alive": 0, "stream": False},
                 what="unload the model", timeout=60),
    ),
    wake=(
        HttpStep("POST", "/api/generate", body={"model": "{served_name}", "keep_alive": -1, "stream": False},
                 what="load the model"),
    ),
    asleep=(HttpStep("GET", "/api/ps", lacks='"name":"{served_name}', what="the model is unloaded", timeout=5),),
    needs_file=True,
    term_grace=5.0,
    container_command=("/bin/sh", "-c"),
    container_args=(POD_SCRIPT, "ollama-pod", "{model}", "{served_name}"),
)
