"""The builtin engine and KEDA take the same decisions for the same demand.

One table of demand series, each fed (as gateway reports, one a second) to two scalers:

* builtin: the scaling core the builtin engine applies (`Verdict.replicas` is what it PATCHes
  into `deployments/scale`);
* KEDA: the real `externalscaler.ExternalScaler` gRPC service over its own core, asked what KEDA
  asks (IsActive, GetMetricSpec, GetMetrics), with KEDA's and the HPA's documented rules on top,
  configured from the ScaledObject the operator renders for the Model (pollingInterval,
  cooldownPeriod, the HPA's stabilization windows): KEDA scales 0 -> 1 when IsActive turns true
  (pushed: at once) and to 0 at its first poll (every pollingInterval) that finds it false after
  cooldownPeriod; between 1 and max, the HPA (one sync a second here) wants
  `ceil(metric / target)` outside its 10 % tolerance, the lowest recommendation of the scale-up
  window and the highest of the scale-down window (kube-controller-manager's
  `stabilizeRecommendationWithBehaviors`).

Both must go through the same replica counts in the same order, each change within one HPA sync
of the other (the HPA sees demand only at its syncs, so its windows close on the first sync past
them, where the builtin engine evaluates at the exact instant), the step to zero within one
pollingInterval.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from wakegate.control.demand.book import DemandBook
from wakegate.control.k8s.objects import model_from_object
from wakegate.control.keda.hub import Hub
from wakegate.control.keda.service import serve_external_scaler
from wakegate.control.operator import render as rnd
from wakegate.control.scaling.core import Core
from wakegate.externalscaler import externalscaler_pb2, externalscaler_pb2_grpc
from wakegate.v1 import demand_pb2

#: Seconds between reports and between HPA syncs.
TICK = 1.0


def model_body(**scaling: Any) -> dict[str, Any]:
    return {
        "apiVersion": "wakegate.io/v1alpha1",
        "kind": "Model",
        "metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": 1},
        "spec": {"backend": "sim", "scaling": {"engine": "keda", **scaling}},
    }


@dataclass
class Hpa:
    """kube-controller-manager's HPA for one AverageValue external metric, with behavior windows."""

    min: int
    max: int
    target: float
    up_window: float
    down_window: float
    tolerance: float = 0.1
    recommendations: list[tuple[float, int]] = field(default_factory=list)

    def sync(self, now: float, current: int, metric: float) -> int:
        if current == 0:
            return 0  # ScalingDisabled: KEDA owns 0 <-> 1
        ratio = metric / (self.target * current)
        desired = current if abs(1.0 - ratio) <= self.tolerance else math.ceil(metric / self.target)
        self.recommendations.append((now, desired))
        horizon = now - max(self.up_window, self.down_window)
        self.recommendations = [(t, r) for t, r in self.recommendations if t > horizon]
        up = min([desired] + [r for t, r in self.recommendations if t > now - self.up_window])
        down = max([desired] + [r for t, r in self.recommendations if t > now - self.down_window])
        recommendation = max(current, up)
        recommendation = min(recommendation, down)
        return min(max(recommendation, self.min), self.max)


@dataclass
class Keda:
    """KEDA's scale loop for a ScaledObject (the operator's), over what the external scaler says."""

    scaled_object: dict[str, Any]
    hpa: Hpa
    last_active: float | None = None

    @classmethod
    def of(cls, scaled_object: dict[str, Any], target: float) -> Keda:
        spec = scaled_object["spec"]
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        hpa = Hpa(
            min=max(1, spec["minReplicaCount"]),
            max=spec["maxReplicaCount"],
            target=target,
            up_window=behavior["scaleUp"]["stabilizationWindowSeconds"],
            down_window=behavior["scaleDown"]["stabilizationWindowSeconds"],
        )
        return cls(scaled_object, hpa)

    def loop(self, now: float, current: int, active: bool, metric: float) -> int:
        spec = self.scaled_object["spec"]
        if active:
            if current == 0:
                return max(1, spec["minReplicaCount"])
            self.last_active = now
        elif (
            current > 0
            and spec["minReplicaCount"] == 0
            and now % spec["pollingInterval"] == 0
            and (self.last_active is None or now >= self.last_active + spec["cooldownPeriod"])
        ):
            return 0
        return self.hpa.sync(now, current, metric)


#: (name, scaling spec, demand steps: (from second, queued + in flight)), run for `seconds`.
SERIES: list[tuple[str, dict[str, Any], list[tuple[float, int]], float]] = [
    (
        "wake, scale out to max, scale in, idle to zero",
        {"min": 0, "max": 4, "idleTimeout": 20, "targetInFlight": 2},
        [(0, 0), (3, 1), (6, 7), (20, 1), (60, 0)],
        110,
    ),
    (
        "a burst shorter than the scale-out window changes nothing",
        {"min": 0, "max": 4, "idleTimeout": 20, "targetInFlight": 2},
        [(0, 1), (10, 9), (11, 1), (30, 0)],
        60,
    ),
    (
        "demand back inside the scale-in window restarts it",
        {"min": 0, "max": 3, "idleTimeout": 40, "targetInFlight": 1},
        [(0, 3), (10, 1), (25, 3), (26, 1), (80, 0)],
        140,
    ),
    (
        "min 1 never goes to zero; idle scales in to 1",
        {"min": 1, "max": 3, "idleTimeout": 30, "targetInFlight": 1},
        [(0, 0), (5, 3), (15, 0)],
        70,
    ),
    (
        "partial steps: out to what demand needs, then further",
        {"min": 0, "max": 5, "idleTimeout": 15, "targetInFlight": 2},
        [(0, 3), (10, 6), (20, 10), (40, 0)],
        90,
    ),
]


def demand_at(steps: list[tuple[float, int]], now: float) -> int:
    return next(value for start, value in reversed(steps) if now >= start)


def report(book: DemandBook, sequence: int, now: float, value: int) -> None:
    load = demand_pb2.ModelDemand(model="ns/m", queued=0, in_flight=value)
    accepted, why = book.apply(
        demand_pb2.DemandReport(gateway_id="gw", instance="i", sequence=sequence, models=[load]), now
    )
    assert accepted, why


def changes(series: list[tuple[float, int]]) -> list[tuple[float, int]]:
    out: list[tuple[float, int]] = []
    for now, replicas in series:
        if not out or out[-1][1] != replicas:
            out.append((now, replicas))
    return out


async def run_both(
    scaling: dict[str, Any], steps: list[tuple[float, int]], seconds: float
) -> tuple[list[tuple[float, int]], list[tuple[float, int]]]:
    body = model_body(**scaling)
    model = model_from_object(body)
    scaled_object = rnd.scaled_object(body, model, rnd.Settings())
    clock = [0.0]

    builtin_book, keda_book = DemandBook(), DemandBook()
    builtin = Core(builtin_book)
    builtin.set_models([model], 0.0)
    core = Core(keda_book)
    core.set_models([model], 0.0)
    hub = Hub(core, clock=lambda: clock[0])
    hub.evaluate()
    server, port = await serve_external_scaler(hub, "127.0.0.1:0")
    ref = externalscaler_pb2.ScaledObjectRef(
        name=scaled_object["metadata"]["name"],
        namespace="ns",
        scalerMetadata=scaled_object["spec"]["triggers"][0]["metadata"],
    )
    builtin_series: list[tuple[float, int]] = []
    keda_series: list[tuple[float, int]] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = externalscaler_pb2_grpc.ExternalScalerStub(channel)
            spec = (await stub.GetMetricSpec(ref)).metricSpecs[0]
            keda = Keda.of(scaled_object, spec.targetSizeFloat)
            replicas = 0
            tick = 0
            while tick * TICK <= seconds:
                now = clock[0] = tick * TICK
                value = demand_at(steps, now)
                report(builtin_book, tick + 1, now, value)
                report(keda_book, tick + 1, now, value)
                verdicts, _ = builtin.evaluate(now)
                builtin_series.append((now, verdicts["ns/m"].replicas))
                hub.evaluate()
                active = (await stub.IsActive(ref)).result
                metrics = await stub.GetMetrics(
                    externalscaler_pb2.GetMetricsRequest(scaledObjectRef=ref, metricName=spec.metricName)
                )
                replicas = keda.loop(now, replicas, active, metrics.metricValues[0].metricValueFloat)
                keda_series.append((now, replicas))
                tick += 1
    finally:
        await server.stop(None)
    return changes(builtin_series), changes(keda_series)


@pytest.mark.parametrize(("scaling", "steps", "seconds"), [row[1:] for row in SERIES], ids=[row[0] for row in SERIES])
def test_builtin_and_keda_take_the_same_decisions(
    scaling: dict[str, Any], steps: list[tuple[float, int]], seconds: float
) -> None:
    builtin, keda = asyncio.run(run_both(scaling, steps, seconds))
    assert [r for _, r in builtin] == [r for _, r in keda], f"builtin {builtin}\nkeda    {keda}"
    polling = rnd.polling_interval(scaling["idleTimeout"])
    for (t_builtin, replicas), (t_keda, _) in zip(builtin, keda, strict=True):
        late = t_keda - t_builtin
        assert -TICK <= late <= (polling if replicas == 0 else TICK), f"builtin {builtin}\nkeda    {keda}"
    # Every series scales at all (a table row that never moves would prove nothing).
    assert len(builtin) > 1
