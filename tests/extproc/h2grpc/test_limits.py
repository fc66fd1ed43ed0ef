"""The HTTP/2 server's limits: how they are set, the token buckets that keep them, and the one
Envoy must share with extproc (its cluster's max_concurrent_streams)."""

from __future__ import annotations

import dataclasses
import re
import time

import pytest
import yaml

from tests.support import REPO_ROOT
from wakegate import contract
from wakegate.control import bootstrap
from wakegate.extproc.h2grpc.limits import Budget, H2Limits


def test_overrides_take_names_with_dashes_or_underscores_and_keep_the_rest() -> None:
    limits = H2Limits().with_overrides(["ping-burst=5", "idle_timeout=0.5", "max_concurrent_streams=7"])
    assert (limits.ping_burst, limits.idle_timeout, limits.max_concurrent_streams) == (5, 0.5, 7)
    assert limits.settings_burst == H2Limits().settings_burst


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("nope=1", "unknown h2 limit"),
        ("ping_burst", "unknown h2 limit"),
        ("ping_burst=x", "takes a number"),
        ("ping_burst=0", "must be positive"),
        ("max_frame_size=1000", "16384..16777215"),
    ],
)
def test_bad_overrides_say_what_is_wrong(item: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        H2Limits().with_overrides([item])


def test_budget_spends_its_burst_then_refills_with_time_and_work() -> None:
    budget = Budget(3, 20.0)
    assert [budget.take() for _ in range(4)] == [True, True, True, False]
    budget.earn(1)
    assert budget.take() and not budget.take()
    time.sleep(0.12)  # 20/s: at least two tokens back, never more than the burst
    assert budget.take() and budget.take()
    time.sleep(1.0)
    assert sum(budget.take() for _ in range(10)) == 3


def test_envoy_opens_no_more_streams_per_extproc_connection_than_extproc_allows() -> None:
    ports = bootstrap.GatewayPorts(envoy_admin=1, xds=2, extproc=3, activator=4)
    clusters = {c["name"]: c for c in yaml.safe_load(bootstrap.render("n", ports))["static_resources"]["clusters"]}
    options = clusters[contract.EXTPROC_CLUSTER]["typed_extension_protocol_options"]
    http2 = next(iter(options.values()))["explicit_http_config"]["http2_protocol_options"]
    assert http2["max_concurrent_streams"] == H2Limits().max_concurrent_streams


def test_up_renders_envoy_with_the_stream_limit_it_gives_extproc() -> None:
    from wakegate.control.up.supervisor import _extproc_streams

    ports = bootstrap.GatewayPorts(envoy_admin=1, xds=2, extproc=3, activator=4)
    streams = _extproc_streams(("ping_burst=5", "max-concurrent-streams=64"))
    assert streams == 64 and _extproc_streams(("ping_burst=5",)) is None
    config = yaml.safe_load(bootstrap.render("n", ports, extproc_streams=streams))
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    options = clusters[contract.EXTPROC_CLUSTER]["typed_extension_protocol_options"]
    http2 = next(iter(options.values()))["explicit_http_config"]["http2_protocol_options"]
    assert http2["max_concurrent_streams"] == 64


def test_up_passes_limits_on_and_refuses_what_is_not_name_equals_number() -> None:
    import argparse

    from wakegate.control.up.main import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--extproc-h2-limit", "ping_burst=5", "--extproc-h2-limit", "idle_timeout=0.5"])
    assert args.extproc_h2_limit == ["ping_burst=5", "idle_timeout=0.5"]
    for bad in ("ping_burst", "ping_burst=lots", "=5"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--extproc-h2-limit", bad])


UNITS = {"KiB": 1024, "MiB": 1024 * 1024}


def documented_defaults() -> dict[str, float]:
    """Each limit's default as docs/decisions.md's table of HTTP/2 limits states it: the names in
    the first column (`ping_*` stands for ping_burst and ping_per_second, in H2Limits' order),
    their numbers in the second, in the same order."""
    fields = [f.name for f in dataclasses.fields(H2Limits)]
    out: dict[str, float] = {}
    for line in (REPO_ROOT / "docs" / "decisions.md").read_text().splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) < 4 or not cells[1].startswith("`") or not re.match(r"\d", cells[2]):
            continue
        numbers = [
            float(n.replace(" ", "")) * UNITS.get(unit, 1)
            for n, unit in re.findall(r"(\d+(?: \d{3})*(?:\.\d+)?)\s*(KiB|MiB)?", cells[2])
        ]
        names = re.findall(r"`([a-z_*]+)`", cells[1])
        if not names or any(n.rstrip("*").rstrip("_") not in "".join(fields) for n in names):
            continue
        groups = [[f for f in fields if f.startswith(n[:-1])] if n.endswith("*") else [n] for n in names]
        if all(len(g) == len(numbers) for g in groups):
            pairs = [(f, v) for g in groups for f, v in zip(g, numbers, strict=True)]
        else:
            pairs = list(zip([f for g in groups for f in g], numbers, strict=True))
        out.update(pairs)
    return out


def test_the_shipped_defaults_are_the_documented_ones() -> None:
    shipped = dataclasses.asdict(H2Limits())
    assert documented_defaults() == shipped
