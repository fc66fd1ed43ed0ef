"""The scaler's /metrics carry the cluster side of what the dashboards read: activation leases per model
and GPU-group swaps per group (`wakegate up` exports the same names)."""

from __future__ import annotations

from prometheus_client import generate_latest

from tests.support.models import demand, models
from wakegate.control.demand.book import DemandBook
from wakegate.control.manifests import parse_models
from wakegate.control.scaler.metrics import ScalerMetrics
from wakegate.control.scaling.core import Core

#: A member of GPU group g with no min run, cooldown or demand window: a swap happens at once.
SWAPPABLE = {
    "scaling": {"min": 0, "max": 1, "idleTimeout": 30},
    "gpu": {"shared": "g", "minRunSeconds": 0, "swapCooldownSeconds": 0, "demandWindowSeconds": 0},
}
MODELS = models({"a": SWAPPABLE, "b": SWAPPABLE})


class Refusals:
    refused = {"demand": 3}


def samples(metrics: ScalerMetrics) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    return {
        series: float(value)
        for line in text.splitlines()
        if line and not line.startswith("#")
        for series, value in [line.rsplit(" ", 1)]
    }


def test_leases_and_swaps_follow_the_core() -> None:
    book = DemandBook()
    core = Core(book)
    core.set_models(parse_models(MODELS), 0.0)
    metrics = ScalerMetrics(book, core, lambda: 0, lambda: True, Refusals())
    core.evaluate(0.0)
    before = samples(metrics)
    assert before['wakegate_model_activation_leases{model="ns/a"}'] == 0
    assert before['wakegate_gpu_swaps_total{group="ns/g"}'] == 0
    # The scaler's demand port counts what it refused under the alert's series; no `ads` here.
    assert before['wakegate_internal_auth_refused_total{service="demand"}'] == 3
    assert not any('service="ads"' in series for series in before)

    demand(book, 1, 1.0, {"a": 1}, leases=True)
    core.evaluate(1.0)
    assert core.verdicts["ns/a"].active
    assert samples(metrics)['wakegate_model_activation_leases{model="ns/a"}'] == 1

    # Demand moves to b: b takes the group from a, one swap.
    demand(book, 2, 2.0, {"b": 1}, leases=True)
    core.evaluate(3.0)
    after = samples(metrics)
    assert core.verdicts["ns/b"].active
    assert after['wakegate_model_activation_leases{model="ns/b"}'] == 1
    assert after['wakegate_model_activation_leases{model="ns/a"}'] == 0
    assert after['wakegate_gpu_swaps_total{group="ns/g"}'] == 1
