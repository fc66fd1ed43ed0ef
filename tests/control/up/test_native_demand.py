"""Demand of natively routed requests from Envoy's counters, into the same demand book."""

from __future__ import annotations

from wakegate.control.demand.book import DemandBook
from wakegate.control.up.native import NativeDemand
from wakegate.envoycounters import parse_counters
from wakegate.v1 import demand_pb2


def loads(report: demand_pb2.DemandReport) -> dict[str, int]:
    return {m.model: m.in_flight for m in report.models}


def test_envoys_active_requests_beyond_extprocs_share_are_native_demand() -> None:
    native = NativeDemand("gw/envoy-native")
    first = native.report({"n": (3, 10), "d": (2, 5)}, ["n"], {"n": 1, "d": 2})
    assert loads(first) == {"n": 2}  # 3 in Envoy, 1 of them extproc's; "d" is not native
    # The book's totals now hold this member's 2 as well: they are not counted as extproc's.
    again = native.report({"n": (3, 10)}, ["n"], {"n": 3})
    assert loads(again) == {"n": 2}
    assert again.sequence == first.sequence + 1 and again.instance == first.instance


def test_a_request_between_two_polls_still_counts_for_that_interval() -> None:
    native = NativeDemand("gw/envoy-native")
    assert loads(native.report({"n": (0, 4)}, ["n"], {})) == {}  # the first poll: no earlier total
    assert loads(native.report({"n": (0, 5)}, ["n"], {})) == {"n": 1}  # one came and went
    assert loads(native.report({"n": (0, 5)}, ["n"], {})) == {}  # idle from here


def test_reports_feed_the_demand_book_like_any_gateway() -> None:
    book = DemandBook()
    native = NativeDemand("gw/envoy-native")
    assert book.apply(native.report({"n": (4, 9)}, ["n"], {}), 0.0) == (True, "")
    assert book.totals()["n"].in_flight == 4
    assert book.apply(native.report({"n": (0, 9)}, ["n"], {"n": 4}), 0.25) == (True, "")
    assert book.totals().get("n") is None or book.totals()["n"].in_flight == 0


def test_parse_counters_takes_only_model_clusters_it_knows() -> None:
    stats = [
        {"name": "cluster.model_ns_n.upstream_rq_active", "value": 2},
        {"name": "cluster.model_ns_n.upstream_rq_total", "value": 40},
        {"name": "cluster.model_other.upstream_rq_total", "value": 7},
        {"name": "cluster.wakegate_extproc.upstream_rq_active", "value": 9},
    ]
    assert parse_counters(stats, {"model_ns_n": "ns/n"}) == {"ns/n": (2, 40)}
