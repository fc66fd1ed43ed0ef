"""Verdicts from summed demand: wake at once, idle to zero, GPU-group losers inactive."""

from __future__ import annotations

import pytest

from tests.support.models import demand, models
from wakegate.control.demand.book import DemandBook
from wakegate.control.manifests import parse_models
from wakegate.control.scaling.core import Core

MODELS = models(
    {
        "a": {
            "scaling": {"min": 0, "max": 4, "idleTimeout": 30, "targetInFlight": 2},
            "gpu": {"shared": "g", "priority": 1},
        },
        "b": {"scaling": {"min": 0, "max": 1, "idleTimeout": 30}, "gpu": {"shared": "g", "priority": 0}},
    }
)


def test_wake_scale_out_idle() -> None:
    book = DemandBook()
    core = Core(book)
    core.set_models(parse_models(MODELS), 0.0)
    verdicts, _ = core.evaluate(0.0)
    assert not verdicts["ns/a"].active
    demand(book, 1, 1.0, {"a": 1})
    verdicts, _ = core.evaluate(1.0)
    assert verdicts["ns/a"].active and verdicts["ns/a"].replicas == 1 and verdicts["ns/a"].demand == 1
    demand(book, 2, 1.5, {"a": 7})
    verdicts, next_at = core.evaluate(1.5)
    assert verdicts["ns/a"].replicas == 1 and next_at == 3.5  # scale-out window
    verdicts, _ = core.evaluate(3.5)
    assert verdicts["ns/a"].replicas == 4
    demand(book, 3, 4.0, {})
    verdicts, next_at = core.evaluate(4.0)
    assert verdicts["ns/a"].active and next_at is not None
    verdicts, _ = core.evaluate(34.0)
    assert not verdicts["ns/a"].active and verdicts["ns/a"].replicas == 0


def test_group_loser_reports_inactive() -> None:
    book = DemandBook()
    core = Core(book)
    core.set_models(parse_models(MODELS), 0.0)
    demand(book, 1, 0.0, {"a": 1, "b": 3})
    verdicts, _ = core.evaluate(0.0)
    assert verdicts["ns/a"].active
    assert not verdicts["ns/b"].active and verdicts["ns/b"].demand == 0 and verdicts["ns/b"].busy
    assert core.group_active("ns/g") == "ns/a"


def test_restart_starts_from_current_replicas() -> None:
    core = Core(DemandBook())
    core.set_models(parse_models(MODELS), 100.0, {"ns/a": 2})
    verdicts, next_at = core.evaluate(100.0)
    assert verdicts["ns/a"].replicas == 2 and verdicts["ns/a"].active
    assert next_at == 130.0  # idle timeout counts from the restart


def test_a_lease_older_than_the_newest_failed_activation_does_not_wake_again() -> None:
    book = DemandBook()
    core = Core(book)
    core.set_models(parse_models(MODELS), 0.0)
    demand(book, 1, 0.0, {"b": 1}, leases=True)
    verdicts, _ = core.evaluate(0.0, failures={"ns/b": 0})
    assert verdicts["ns/b"].replicas == 1
    # The load failed (failures -> 1) and the replica went away without a verdict.
    core.resync("ns/b", 0)
    verdicts, _ = core.evaluate(1.0, failures={"ns/b": 1})
    assert verdicts["ns/b"].replicas == 0, "the stale lease must not start a retry loop"
    demand(book, 2, 2.0, {"b": 1}, leases=True, failures_seen=1)
    verdicts, _ = core.evaluate(2.0, failures={"ns/b": 1})
    assert verdicts["ns/b"].replicas == 1, "a lease begun after the failure starts a new activation"


# --- GPU group hand-over with pod counts (what the cluster scaler and `up` pass as `live`) -------

GROUP_SCALING = {"min": 0, "max": 1, "idleTimeout": 2}
GROUP_GPU = {"shared": "g", "minRunSeconds": 0, "swapCooldownSeconds": 60, "demandWindowSeconds": 0}
GROUP_MODELS = models(
    {
        "a": {"scaling": GROUP_SCALING, "gpu": GROUP_GPU},
        "b": {"scaling": GROUP_SCALING, "gpu": {**GROUP_GPU, "queueThreshold": 2}},
    }
)

Step = tuple[float, dict[str, int], dict[str, int] | None]
#: id, steps (now, queued per model, pods per model or None), then after the last step: replicas,
#: waiting_for and the group's holder.
HANDOVER: list[tuple[str, list[Step], dict[str, int], dict[str, str], str | None]] = [
    (
        "below-the-threshold-b-waits-for-the-holder",
        [(0, {"a": 1}, {}), (5, {"a": 1, "b": 1}, {"a": 1})],
        {"a": 1, "b": 0},
        {"b": "ns/a"},
        "ns/a",
    ),
    (
        "at-the-threshold-b-takes-the-group-but-waits-for-a-to-drain",
        [(0, {"a": 1}, {}), (5, {"a": 1, "b": 2}, {"a": 1})],
        {"a": 0, "b": 0},
        {"a": "ns/b", "b": "ns/a"},
        "ns/b",
    ),
    (
        "b-starts-once-a-pods-are-deleted",
        [(0, {"a": 1}, {}), (5, {"a": 1, "b": 2}, {"a": 1}), (6, {"a": 1, "b": 2}, {})],
        {"a": 0, "b": 1},
        {"a": "ns/b"},
        "ns/b",
    ),
    (
        "an-idle-holder-releases-the-group-only-once-its-pods-are-gone",
        [(0, {"a": 1}, {}), (1, {}, {"a": 1}), (4, {"b": 1}, {"a": 1})],
        {"a": 0, "b": 0},
        {"b": "ns/a"},
        "ns/a",
    ),
    (
        "a-released-group-goes-to-b-below-its-threshold",
        [(0, {"a": 1}, {}), (1, {}, {"a": 1}), (4, {"b": 1}, {"a": 1}), (5, {"b": 1}, {})],
        {"a": 0, "b": 1},
        {},
        "ns/b",
    ),
    (
        "without-pod-counts-b-starts-with-the-swap",
        [(0, {"a": 1}, None), (5, {"a": 1, "b": 2}, None)],
        {"a": 0, "b": 1},
        {"a": "ns/b"},
        "ns/b",
    ),
]


@pytest.mark.parametrize(
    ("steps", "replicas", "waiting", "holder"), [pytest.param(*row[1:], id=row[0]) for row in HANDOVER]
)
def test_gpu_group_handover(
    steps: list[Step], replicas: dict[str, int], waiting: dict[str, str], holder: str | None
) -> None:
    book = DemandBook()
    core = Core(book)
    core.set_models(parse_models(GROUP_MODELS), 0.0)
    for seq, (now, queued, live) in enumerate(steps, 1):
        demand(book, seq, now, queued)
        verdicts, _ = core.evaluate(now, None if live is None else {f"ns/{k}": v for k, v in live.items()})
    assert {k.removeprefix("ns/"): v.replicas for k, v in verdicts.items()} == replicas
    assert {k.removeprefix("ns/"): v.waiting_for for k, v in verdicts.items() if v.waiting_for} == waiting
    assert core.group_active("ns/g") == holder
