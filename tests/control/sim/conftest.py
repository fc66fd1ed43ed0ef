"""Fixtures of the sim tests: a factory that stops what it started, and one shared fast sim."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.sim import SimFactory, SimProcess, start_sim


@pytest.fixture
def sim_factory() -> Iterator[SimFactory]:
    started: list[SimProcess] = []

    def factory(*args: str, wait_ready: bool = True) -> SimProcess:
        sim = start_sim(0, *args, wait_ready=wait_ready)
        started.append(sim)
        return sim

    yield factory
    for sim in started:
        sim.stop(timeout=5)


@pytest.fixture(scope="module")
def shared_sim() -> Iterator[SimProcess]:
    """One fast sim for the API-shape tests: two served names, a LoRA adapter, EOS after 50 tokens."""
    sim = start_sim(
        0,
        "--served-model-name",
        "sim-model,sim-alias",
        "--lora-modules",
        "sim-lora=/adapters/sim-lora",
        "--eos-after-tokens",
        "50",
    )
    yield sim
    assert sim.stop() == 0
