"""wakegate.envoycounters: the native share of Envoy's per-model counters, shared by `up` and extproc."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from wakegate.envoycounters import STATS_QUERY, NativeInFlight, parse_counters, stat_name


def test_a_model_without_counters_yet_starts_from_zero() -> None:
    # With `usedonly`, Envoy lists no stats for a cluster no request reached: that is zero, so the
    # very first request, begun and ended between two polls, still counts for its interval.
    native = NativeInFlight()
    assert native.update({}, ["n"], {}) == {"n": 0}
    assert native.update({"n": (0, 1)}, ["n"], {}) == {"n": 1}
    assert native.update({"n": (0, 1)}, ["n"], {}) == {"n": 0}


def test_extprocs_own_requests_are_not_native() -> None:
    native = NativeInFlight()
    assert native.update({"n": (5, 9)}, ["n"], {"n": 2}) == {"n": 3}
    assert native.update({"n": (2, 9)}, ["n"], {"n": 4}) == {"n": 0}  # never below zero


def test_the_query_reads_only_the_two_counters_of_model_clusters() -> None:
    query = parse_qs(urlsplit(STATS_QUERY).query, keep_blank_values=True)
    assert query["format"] == ["json"] and "usedonly" in query
    stats = [
        {"name": f"cluster.{stat_name('ns/my-model.v2')}.upstream_rq_active", "value": 1},
        {"name": f"cluster.{stat_name('ns/my-model.v2')}.upstream_rq_total", "value": 3},
    ]
    assert parse_counters(stats, {stat_name("ns/my-model.v2"): "ns/my-model.v2"}) == {"ns/my-model.v2": (1, 3)}
