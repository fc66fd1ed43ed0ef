"""One real `wakegate up` with scale-to-zero models, shared by the cold-path tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.up import UpProcess, model_doc
from wakegate.control.admin import free_port

#: cold-crash's activationTimeout: its start attempts are retried within it.
CRASH_TIMEOUT = 15


#: Each model's spec; the tests parametrized over both paths take the model and its twin on the
#: native path once warm (`<name>n`, strategy round-robin, `native_twin`): while cold both are
#: decided (held, woken, refused by extproc), and nothing of that may change because the warm
#: model will be routed by Envoy alone.
def specs(faults: Path) -> dict[str, str]:
    return {
        "cold-a": """  args: [--startup-seconds, "2"]
  scaling: {min: 0, max: 1, idleTimeout: 3}
""",
        "cold-q": """  args: [--startup-seconds, "3"]
  scaling: {min: 0, max: 1, idleTimeout: 120}
  endpoint: {maxQueue: 100}
""",
        "cold-k": """  args: [--startup-seconds, "2", --tokens-per-second, "50"]
  scaling: {min: 0, max: 1, idleTimeout: 120}
  endpoint: {coldMode: keepalive}
""",
        "cold-d": """  args: [--startup-seconds, "4"]
  scaling: {min: 0, max: 1, idleTimeout: 120}
""",
        "cold-p": """  args: [--startup-seconds, "3"]
  scaling: {min: 0, max: 1, idleTimeout: 120}
  endpoint: {maxQueue: 100}
""",
        "cold-crash": f"""  args: [--startup-seconds, "1", --fault-file, "{faults / "crash"}"]
  scaling: {{min: 0, max: 1, idleTimeout: 3, activationTimeout: {CRASH_TIMEOUT}}}
""",
        "cold-hang": f"""  args: [--fault-file, "{faults / "hang"}"]
  scaling: {{min: 0, max: 1, idleTimeout: 120, activationTimeout: 3}}
""",
    }


def native_twin(name: str) -> str:
    """The name of `name`'s twin on the native path."""
    return f"{name}n"


def warm_path(model: str) -> str:
    """The path `model` takes once warm: native for a twin, else decided (they name no routing)."""
    return "native" if any(model == native_twin(name) for name in specs(Path("."))) else "decided"


def both_paths(*names: str) -> pytest.MarkDecorator:
    """Parametrize a test's `model` over each name and its native twin."""
    values = [
        p
        for name in names
        for p in (pytest.param(name, id=f"{name}-decided"), pytest.param(native_twin(name), id=f"{name}-native"))
    ]
    return pytest.mark.parametrize("model", values)


def fleet(faults: Path) -> str:
    docs = [model_doc(name, extra=extra) for name, extra in specs(faults).items()]
    twins = [
        model_doc(native_twin(name), extra=extra + "  routing: {strategy: round-robin, path: native}\n")
        for name, extra in specs(faults).items()
    ]
    return "".join([*docs, *twins])


@pytest.fixture(scope="session")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="session")
def cold_gateway(tmp_path_factory: pytest.TempPathFactory, faults: Path) -> Iterator[UpProcess]:
    envoy_admin = f"127.0.0.1:{free_port()}"
    args = ("--keepalive-seconds", "0.5", "--envoy-admin-listen", envoy_admin)
    up = UpProcess(tmp_path_factory.mktemp("cold"), fleet(faults), *args)
    up.envoy_admin = envoy_admin
    try:
        up.wait_ready({}, timeout=60)
        yield up
    finally:
        assert up.stop() == 0, up.log()
