"""`wakegate up` with a thousand Models: it serves, lists every one, and wakes any of them.

Until the `up` → feeder link carried framed, incremental messages, the first message of a
few hundred Models outgrew a 64 KiB line and the feeder crash-looped: `up` never served.
How fast it starts and serves at this size is measured in tests/bench/bench_scale.py.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.http import request
from tests.support.up import UpProcess, model_doc

MODELS = 1000


def fleet() -> str:
    docs = []
    for i in range(MODELS):
        warm = i < 2
        docs.append(
            model_doc(
                f"m{i}",
                extra=f"  aliases: [alias-{i}]\n"
                f"  scaling: {{min: {1 if warm else 0}, max: 1, idleTimeout: 600, activationTimeout: 120}}\n",
            )
        )
    return "".join(docs)


def chat(up: UpProcess, model: str) -> tuple[int, dict[str, object]]:
    response = request(
        "POST",
        f"{up.base_url}/chat/completions",
        body={"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4},
        timeout=120,
    )
    return response.status, response.json()


def test_a_thousand_models_serve_list_and_wake(tmp_path: Path) -> None:
    up = UpProcess(tmp_path, fleet())
    try:
        up.wait_ready({"m0": 1, "m1": 1}, timeout=240)
        listing = request("GET", f"{up.base_url}/models").json()
        names = {entry["id"] for entry in listing["data"]}
        assert {f"m{i}" for i in range(MODELS)} <= names and {f"alias-{i}" for i in range(MODELS)} <= names

        # Warm, and the last Model of the file (at zero) woken by its alias, then by its name.
        status, body = chat(up, "m1")
        assert status == 200, body
        status, body = chat(up, f"alias-{MODELS - 1}")
        assert status == 200 and body["model"] == f"m{MODELS - 1}", body
        status, body = chat(up, "m500")
        assert status == 200, body
        ready = {m["key"]: m["ready"] for m in up.status()["models"]}
        assert ready[f"m{MODELS - 1}"] == 1 and ready["m500"] == 1 and sum(ready.values()) == 4
        assert "Traceback" not in (tmp_path / "state" / "logs" / "feeder.log").read_text()
    finally:
        assert up.stop() == 0, up.log()[-5000:]
