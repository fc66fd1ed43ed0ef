"""One real `wakegate up` with scale-to-zero models, shared by the cold-path tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.up import UpProcess, model_doc


def fleet(faults: Path) -> str:
    return "".join(
        [
            model_doc(
                "cold-a",
                extra="""  args: [--startup-seconds, "2"]
  scaling: {min: 0, max: 1, idleTimeout: 3}
""",
            ),
            # cold-a's twin on the native path once warm (tests parametrized over both).
            model_doc(
                "cold-an",
                extra="""  args: [--startup-seconds, "2"]
  routing: {strategy: round-robin, path: native}
  scaling: {min: 0, max: 1, idleTimeout: 3}
""",
            ),
            model_doc(
                "cold-q",
                extra="""  args: [--startup-seconds, "3"]
  scaling: {min: 0, max: 1, idleTimeout: 120}
  endpoint: {maxQueue: 100}
""",
            ),
            model_doc(
                "cold-k",
                extra="""  args: [--startup-seconds, "2", --tokens-per-second, "50"]
  scaling: {min: 0, max: 1, idleTimeout: 120}
  endpoint: {coldMode: keepalive}
""",
            ),
            model_doc(
                "cold-d",
                extra="""  args: [--startup-seconds, "4"]
  scaling: {min: 0, max: 1, idleTimeout: 120}
""",
            ),
            model_doc(
                "cold-crash",
                extra=f"""  args: [--startup-seconds, "1", --fault-file, "{faults / "crash"}"]
  scaling: {{min: 0, max: 1, idleTimeout: 120, activationTimeout: 20}}
""",
            ),
            model_doc(
                "cold-hang",
                extra=f"""  args: [--fault-file, "{faults / "hang"}"]
  scaling: {{min: 0, max: 1, idleTimeout: 120, activationTimeout: 3}}
""",
            ),
        ]
    )


@pytest.fixture(scope="session")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="session")
def cold_gateway(tmp_path_factory: pytest.TempPathFactory, faults: Path) -> Iterator[UpProcess]:
    up = UpProcess(tmp_path_factory.mktemp("cold"), fleet(faults), "--keepalive-seconds", "0.5")
    try:
        up.wait_ready({}, timeout=60)
        yield up
    finally:
        assert up.stop() == 0, up.log()
