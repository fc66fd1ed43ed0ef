"""StreamIsActive latency: how soon KEDA hears `true` after demand appears.

Run from the repository root (not collected by `pytest tests`):

    python -m tests.bench.bench_scaler [--cold 20] [--reports 500] [--json OUT]

Two measurements, each with a client generated from KEDA's externalscaler.proto:

* cold: one `wakegate up --scaler-listen` with a `min: 0` sim model (idleTimeout 1 s). Each
  round waits until the model is back at zero replicas and the stream said `false`, then sends
  one chat completion through the gateway and times request sent -> `true` on StreamIsActive
  (Envoy -> extproc cold path -> demand report -> verdict -> stream).
* report: one `wakegate scaler --models-file`; each round sends a DemandReport with demand over
  gRPC and times Report sent -> `true` on the stream (the scaler's own share), then a report
  without demand (KEDA sends `true` again on every rise of demand).

Prints p50/p90/p99/max in milliseconds and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import grpc

from tests.support.http import request
from tests.support.scaler import ScalerProcess, Stream, wait_until
from tests.support.up import UpProcess, model_doc
from wakegate.control.admin import free_port
from wakegate.externalscaler import externalscaler_pb2_grpc
from wakegate.v1 import demand_pb2, demand_pb2_grpc

COLD_MODEL = model_doc("bench-cold", extra="  scaling: {min: 0, max: 1, idleTimeout: 1}\n")


def summary(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return {"n": len(ms), "p50": q[49], "p90": q[89], "p99": q[98], "max": ms[-1]}


def post(url: str, body: dict[str, object], statuses: list[int]) -> None:
    statuses.append(request("POST", url, body=body, timeout=30).status)


def bench_cold(tmp: Path, rounds: int) -> list[float]:
    address = f"127.0.0.1:{free_port()}"
    up = UpProcess(tmp, COLD_MODEL, "--scaler-listen", address)
    samples: list[float] = []
    try:
        up.wait_ready({}, timeout=60)
        with grpc.insecure_channel(address) as channel:
            stub = externalscaler_pb2_grpc.ExternalScalerStub(channel)
            stream = Stream(stub, "bench-cold")
            assert stream.next()[0] is False
            body = {"model": "bench-cold", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            for _ in range(rounds):
                wait_until(lambda: not up.status()["models"][0]["replicas"], 30, "back at zero")
                statuses: list[int] = []
                sent = time.perf_counter()
                worker = threading.Thread(target=post, args=(f"{up.base_url}/chat/completions", body, statuses))
                worker.start()
                active, at = stream.next(timeout=10)
                assert active is True
                samples.append(at - sent)
                worker.join(30)
                assert statuses == [200], statuses
                active, _ = stream.next(timeout=10)
                assert active is False
            stream.close()
    finally:
        up.stop()
    return samples


def bench_reports(tmp: Path, rounds: int) -> list[float]:
    scaler = ScalerProcess(tmp)
    samples: list[float] = []
    token = (("authorization", "Bearer s3cret-token"),)
    try:
        with scaler.channel() as keda, grpc.insecure_channel(scaler.demand) as gw:
            stub = externalscaler_pb2_grpc.ExternalScalerStub(keda)
            demand = demand_pb2_grpc.DemandServiceStub(gw)
            stream = Stream(stub, "wg-m")
            assert stream.next()[0] is False
            sequence = 0
            for _ in range(rounds):
                sequence += 1
                busy = demand_pb2.DemandReport(
                    gateway_id="bench",
                    instance="i",
                    sequence=sequence,
                    models=[demand_pb2.ModelDemand(model="ns/m", queued=1)],
                )
                sent = time.perf_counter()
                demand.Report(busy, metadata=token)
                active, at = stream.next()
                assert active is True
                samples.append(at - sent)
                sequence += 1
                demand.Report(
                    demand_pb2.DemandReport(gateway_id="bench", instance="i", sequence=sequence), metadata=token
                )
            stream.close()
    finally:
        scaler.stop()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold", type=int, default=20, help="cold requests through the gateway")
    parser.add_argument("--reports", type=int, default=500, help="direct demand reports")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results: dict[str, object] = {"loadavg_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="bench-scaler-") as tmp:
        if args.reports:
            (Path(tmp) / "r").mkdir()
            results["report"] = summary(bench_reports(Path(tmp) / "r", args.reports))
        if args.cold:
            (Path(tmp) / "c").mkdir()
            results["cold"] = summary(bench_cold(Path(tmp) / "c", args.cold))
    results["loadavg_after"] = os.getloadavg()
    for name in ("report", "cold"):
        if name in results:
            row = results[name]
            assert isinstance(row, dict)
            print(f"{name:7} n={row['n']:<4} " + " ".join(f"{k}={row[k]:.2f}ms" for k in ("p50", "p90", "p99", "max")))
    print(f"load average before {results['loadavg_before']} after {results['loadavg_after']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
