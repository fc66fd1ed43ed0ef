"""DemandBook rules the scaler relies on: replays, restarts, withdrawals, expiry and bounds."""

from __future__ import annotations

from wakegate.control.demand.book import DemandBook, Limits
from wakegate.v1 import demand_pb2


def report(
    gw: str, inst: str, seq: int, in_flight: int = 1, model: str = "ns/m", **kw: object
) -> demand_pb2.DemandReport:
    return demand_pb2.DemandReport(
        gateway_id=gw,
        instance=inst,
        sequence=seq,
        models=[demand_pb2.ModelDemand(model=model, in_flight=in_flight)],
        **kw,  # type: ignore[arg-type]
    )


def test_sums_newest_report_per_gateway() -> None:
    book = DemandBook()
    for gw, n in (("a", 1), ("b", 2), ("c", 4)):
        assert book.apply(report(gw, "i", 1, n), 0.0)[0]
    assert book.apply(report("a", "i", 2, 3), 0.1)[0]
    assert book.totals()["ns/m"].in_flight == 3 + 2 + 4


def test_replays_are_dropped_and_counted() -> None:
    book = DemandBook()
    assert book.apply(report("a", "i1", 5), 0.0)[0]
    assert book.apply(report("a", "i1", 5), 0.1) == (False, "stale sequence 5 <= 5")
    assert not book.apply(report("a", "i1", 4), 0.1)[0]
    # A restart (new instance) replaces the member; the old instance is now a replay.
    assert book.apply(report("a", "i2", 1, 7), 0.2)[0]
    assert not book.apply(report("a", "i1", 99), 0.3)[0]
    assert book.totals()["ns/m"].in_flight == 7
    assert book.rejections.stale == 3


def test_withdrawal_and_expiry_leave_tombstones_against_replay() -> None:
    book = DemandBook()
    assert book.apply(report("a", "i", 1, 2), 0.0)[0]
    assert book.apply(demand_pb2.DemandReport(gateway_id="a", instance="i", sequence=2, withdraw=True), 0.1)[0]
    assert book.totals() == {}
    assert not book.apply(report("a", "i", 1, 2), 0.2)[0], "a replay of the report before the withdrawal"
    assert book.apply(report("b", "j", 1, 1), 0.0)[0]
    assert book.expire(10.5) == ["b"]
    assert not book.apply(report("b", "j", 1, 1), 10.6)[0]
    assert book.apply(report("b", "j", 2, 1), 10.6)[0], "the same gateway reporting again comes back"
    assert book.members == 1


def test_bounds() -> None:
    book = DemandBook(Limits(max_members=2, max_value=100, max_report_bytes=2000))
    assert book.apply(report("a", "i", 1), 0)[0]
    assert book.apply(report("b", "i", 1), 0)[0]
    assert not book.apply(report("c", "i", 1), 0)[0]
    assert not book.apply(report("a", "i", 2, in_flight=101), 0)[0]
    big = demand_pb2.DemandReport(
        gateway_id="a",
        instance="i",
        sequence=3,
        models=[demand_pb2.ModelDemand(model=f"ns/m{i}", in_flight=1) for i in range(200)],
    )
    assert not book.apply(big, 0)[0]
    assert not book.apply(report("a", "i", 4, model="x" * 300), 0)[0]
    assert book.rejections.counts() == {
        "stale": 0,
        "oversized": 2,
        "too_many_members": 1,
        "unauthenticated": 0,
        "invalid": 1,
    }
