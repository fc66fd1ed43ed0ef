"""Pure-Python pieces of the harness; no cluster needed (but run with the e2e suite)."""

from __future__ import annotations

import pytest

from e2e import images
from e2e.containers import exit_reason
from e2e.nodeagent import IPPool

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    ("image", "recipe"),
    [
        ("ghcr.io/wakegate/sim:latest", images.sim),
        ("wakegate/sim:dev", images.sim),
        ("localhost:5000/wakegate/sim@sha256:abc", images.sim),
        ("wakegate/wakegate", images.wakegate),
        ("wakegate/e2e-exec:dev", images.exec_image),
        ("ghcr.io/other/wakegate-sim:1", None),
        ("vllm/vllm-openai:v0.11", None),
    ],
)
def test_image_lookup(image: str, recipe: images.Recipe | None) -> None:
    assert images.lookup(image) is recipe


def test_expand_follows_kubernetes_rules() -> None:
    env = {"A": "1"}
    assert images.expand("x$(A)y", env) == "x1y"
    assert images.expand("$(MISSING)", env) == "$(MISSING)"
    assert images.expand("$$(A)", env) == "$(A)"


@pytest.mark.parametrize(
    ("code", "expected"),
    [(0, (0, "Completed")), (3, (3, "Error")), (137, (137, "OOMKilled")), (-15, (143, "Error"))],
)
def test_exit_reason(code: int, expected: tuple[int, str]) -> None:
    assert exit_reason(code) == expected


def test_ip_pool_hands_out_each_address_once_until_returned() -> None:
    pool = IPPool("198.18.7.0/30")
    a, b = pool.take(), pool.take()
    assert {a, b} == {"198.18.7.1", "198.18.7.2"}
    with pytest.raises(RuntimeError):
        pool.take()
    pool.give_back(a)
    assert pool.take() == a
