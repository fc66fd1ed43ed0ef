"""LoRAAdapters of a vLLM-style engine (the sim, with vLLM's run-time adapter API) in `wakegate up`:
the adapters' weights come through the delivery library, are loaded into the replica before it is
routed (so the request that woke the base is answered by its adapter), are named to the engine as
the body's `model`, and show in /status with the replica that holds them."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import openai

from tests.support.http import get_json
from tests.support.up import UpProcess

FLEET = """---
apiVersion: wakegate.io/v1alpha1
kind: Model
metadata: {name: chat}
spec:
  backend: sim
  servedName: org/chat
  adapters: {maxAdapters: 2}
  scaling: {min: 0, max: 1, idleTimeout: 300, activationTimeout: 30}
---
apiVersion: wakegate.io/v1alpha1
kind: LoRAAdapter
metadata: {name: sql}
spec: {baseModel: chat, source: file://adapters/sql, servedName: chat-sql}
---
apiVersion: wakegate.io/v1alpha1
kind: LoRAAdapter
metadata: {name: poet}
spec: {baseModel: chat, source: file://adapters/poet, aliases: [verse]}
"""


def chat_status(up: UpProcess) -> dict[str, object]:
    return next(m for m in up.status()["models"] if m["key"] == "chat")


def test_adapters_are_loaded_before_the_woken_base_is_routed(tmp_path: Path) -> None:
    for name in ("sql", "poet"):
        (tmp_path / "adapters" / name).mkdir(parents=True)
        (tmp_path / "adapters" / name / "adapter_config.json").write_text("{}")
    up = UpProcess(tmp_path, FLEET)
    try:
        up.wait_ready({"chat": 0}, timeout=60)
        client = openai.OpenAI(base_url=up.base_url, api_key="unused", max_retries=0, timeout=30)
        served: dict[str, str] = {}

        def ask(name: str) -> None:
            reply = client.completions.create(model=name, prompt="hello", max_tokens=2)
            served[name] = reply.model

        # Requests for two adapters of the sleeping base: one wake, each answered by its adapter.
        threads = [threading.Thread(target=ask, args=(n,)) for n in ("sql", "verse")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
        assert served == {"sql": "chat-sql", "verse": "poet"}
        assert up.log().count("scale model=chat from=0 to=1") == 1
        status = chat_status(up)
        (replica,) = status["replicas"]  # type: ignore[misc]
        engine = f"http://127.0.0.1:{replica['port']}"
        listed = {m["id"]: m for m in get_json(f"{engine}/v1/models")["data"]}
        assert listed["chat-sql"]["root"] == str((tmp_path / "adapters" / "sql").resolve())
        assert listed["poet"]["parent"] == "org/chat"
        adapters = status["adapters"]
        assert isinstance(adapters, dict)
        for name in ("sql", "poet"):
            assert adapters[name]["replicas"] == [f"chat-{replica['index']}"], adapters
            assert adapters[name]["loaded_replicas"] == 1 and adapters[name]["failure"] is None
            assert time.strptime(adapters[name]["last_load"], "%Y-%m-%dT%H:%M:%SZ")
        # The base keeps its own name; nothing restarted.
        assert client.completions.create(model="chat", prompt="hi", max_tokens=1).model == "org/chat"
        assert chat_status(up)["replicas"][0]["pid"] == replica["pid"]  # type: ignore[index]
        pid = replica["pid"]
        argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        assert argv[argv.index("--max-loras") + 1] == "2" and "--enable-lora" in argv
    finally:
        assert up.stop() == 0, up.log()
