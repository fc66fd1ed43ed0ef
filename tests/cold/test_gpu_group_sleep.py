"""A GPU group whose engines can sleep (the sim's implementation of vLLM's sleep API): a swap puts
the outgoing model to sleep instead of stopping it, and the model whose turn comes back is woken,
not started: every prompt is answered by the one process each model started with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.http import request
from tests.support.up import UpProcess, model_doc


def sleeper(name: str) -> str:
    return model_doc(
        name,
        extra="""  args: [--startup-seconds, "1", --wake-seconds, "0.05"]
  scaling: {min: 0, max: 1, sleepAfter: 60, idleTimeout: 120, activationTimeout: 60}
  gpu: {shared: gpu0, minRunSeconds: 0, swapCooldownSeconds: 0, demandWindowSeconds: 0}
""",
    )


def ask(up: UpProcess, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "go"}], "max_tokens": 2}
    response = request("POST", f"{up.base_url}/chat/completions", body=body, timeout=60)
    assert response.status == 200, response.body


def models(up: UpProcess) -> dict[str, dict[str, Any]]:
    return {m["key"]: m for m in up.status()["models"]}


def test_a_swap_sleeps_the_outgoing_model_and_wakes_it_on_its_turn(tmp_path: Path) -> None:
    up = UpProcess(tmp_path, sleeper("g1") + sleeper("g2"))
    try:
        up.wait_ready({}, timeout=60)
        pids: dict[str, set[int]] = {"g1": set(), "g2": set()}
        for model in ("g1", "g2", "g1", "g2"):
            ask(up, model)
            status = models(up)
            other = "g2" if model == "g1" else "g1"
            assert status[model]["tier"] == "warm", status[model]
            pids[model] |= {r["pid"] for r in status[model]["replicas"]}
            if status[other]["replicas"]:
                assert status[other]["tier"] == "asleep", status[other]
        # One process each for the whole run: the second turns were wakes.
        assert len(pids["g1"]) == 1 and len(pids["g2"]) == 1, pids
        savings = up.status()["savings"]["models"]
        assert savings["g1"]["wakes"]["asleep"]["count"] == 1 and savings["g1"]["wakes"]["zero"]["count"] == 1
        assert up.status()["gpu_groups"]["gpu0"]["swaps"] >= 3
    finally:
        assert up.stop() == 0, up.log()
