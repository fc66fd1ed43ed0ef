"""What per-gateway views cost the feeder: one snapshot build with G gateways on record.

Run from the repository root (not collected by `pytest tests`):

    python -m tests.bench.bench_feeder [--models 200] [--gateways 1 10 50] [--rounds 5]

For each gateway count, times `Publisher.publish()` (the base snapshot and one view per
gateway) in two states: every gateway current (its Envoy confirmed every endpoint, its
extproc holds no removed one: each view is the base itself), and one gateway lagging on
every model (its whole view rebuilt). Prints the median in milliseconds and the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

from wakegate.control.feeder.cache import SnapshotCache
from wakegate.control.feeder.publisher import Publisher
from wakegate.control.feeder.routed import RoutedModel
from wakegate.control.feeder.settings import GatewaySettings

Acked = dict[str, frozenset[tuple[str, int]]]


class Acks:
    """Stands in for the ADS server's record (what publish() reads of it)."""

    def __init__(self, confirmed: dict[str, Acked], retained: dict[str, Acked]) -> None:
        self._confirmed = confirmed
        self._retained = retained

    def gateways(self) -> set[str]:
        return set(self._confirmed)

    def confirmed(self, node: str) -> Acked | None:
        return self._confirmed.get(node)

    def retained(self, node: str) -> Acked:
        return self._retained.get(node, {})


def fleet(n: int) -> list[RoutedModel]:
    return [
        RoutedModel(
            key=f"ns/m{i}",
            names=(f"m{i}",),
            served_name=f"m{i}",
            endpoints=tuple((f"10.{i // 250}.{i % 250}.{j}", 8000) for j in range(3)),
        )
        for i in range(n)
    ]


async def publish_ms(models: list[RoutedModel], gateways: int, lagging: bool, rounds: int) -> float:
    publisher = Publisher(SnapshotCache(), GatewaySettings(), lambda: models)
    current = {m.cluster: frozenset(m.endpoints) for m in models}
    confirmed = {f"gw-{g}": dict(current) for g in range(gateways)}
    if lagging and gateways:
        confirmed["gw-0"] = {m.cluster: frozenset(m.endpoints[:2]) for m in models}
    publisher.ads = Acks(confirmed, {g: dict(current) for g in confirmed})  # type: ignore[assignment]
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        await publisher.publish()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    models = fleet(args.models)
    rows = []
    for gateways in args.gateways:
        steady = await publish_ms(models, gateways, False, args.rounds)
        lagging = await publish_ms(models, gateways, True, args.rounds) if gateways else steady
        rows.append({"gateways": gateways, "steady_ms": steady, "one_lagging_ms": lagging})
        print(f"{args.models} models, {gateways:>3} gateways: {steady:7.1f} ms; one lagging on all: {lagging:7.1f} ms")
    print("load average:", " ".join(f"{x:.1f}" for x in os.getloadavg()))
    return {"models": args.models, "rows": rows}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", type=int, default=200)
    parser.add_argument("--gateways", type=int, nargs="+", default=[0, 1, 10, 50])
    parser.add_argument("--rounds", type=int, default=9)
    asyncio.run(main(parser.parse_args()))
