"""The one Prometheus text reader: what prometheus_client writes, it reads sample for sample;
odd lines are skipped, not fatal; labels are read only when asked."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from wakegate import promtext


def test_it_reads_what_prometheus_client_writes() -> None:
    registry = CollectorRegistry()
    Gauge("vllm:num_requests_running", "r", ["model_name"], registry=registry).labels("a b}").set(3)
    Counter("requests", "c", ["code"], registry=registry).labels('say "hi"').inc(2)
    hist = Histogram("latency_seconds", "h", ["model_name"], registry=registry, buckets=(0.1, 1.0))
    hist.labels("m").observe(0.5)
    text = generate_latest(registry).decode()
    theirs = [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]
    ours = [(s.name, promtext.labels(s.labels), s.value) for s in promtext.samples(text)]
    assert [(n, v) for n, _, v in ours] == [(n, v) for n, _, v in theirs]
    assert ours[0][1] == {"model_name": "a b}"}  # a space and a brace inside a label value
    assert ours[1][1] == {"code": 'say \\"hi\\"'}  # escapes are kept as written


def test_odd_lines_are_skipped_and_names_filter_before_values() -> None:
    text = "\n".join([
        "# TYPE x gauge",
        "",
        "x 1",
        "x{a=\"1\"} 2 1700000000000",  # with a timestamp
        "  x 3",  # leading blanks
        "x{broken 4",
        "x notanumber",
        "x",
        "y{a=\"1\"} NaN",
        "z +Inf",
    ])
    got = list(promtext.samples(text))
    assert [(s.name, s.labels, s.value) for s in got[:3]] == [("x", "", 1.0), ("x", 'a="1"', 2.0), ("x", "", 3.0)]
    assert [s.name for s in got] == ["x", "x", "x", "y", "z"]
    assert math.isnan(got[3].value) and got[4].value == math.inf
    assert [s.value for s in promtext.samples(text, {"z"})] == [math.inf]
