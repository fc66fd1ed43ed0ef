"""`wakegate scaler` as a real subprocess on free loopback ports, and a client built from KEDA's proto."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc

from tests.support import REPO_ROOT
from tests.support.models import models
from tests.support.processes import stop_process
from tests.support.waiting import wait_for
from wakegate.control.admin import free_port
from wakegate.externalscaler import externalscaler_pb2, externalscaler_pb2_grpc

#: A model of its own, and two sharing GPU group g (`big` has the higher priority).
MODELS = models(
    {
        "m": {"scaling": {"min": 0, "max": 8, "idleTimeout": 2, "targetInFlight": 4}},
        "big": {
            "scaling": {"min": 0, "max": 1, "idleTimeout": 60},
            "gpu": {"shared": "g", "priority": 5, "minRunSeconds": 60},
        },
        "small": {"scaling": {"min": 0, "max": 1, "idleTimeout": 60}, "gpu": {"shared": "g", "priority": 0}},
    }
)


def ref(name: str, namespace: str = "ns", **metadata: str) -> externalscaler_pb2.ScaledObjectRef:
    return externalscaler_pb2.ScaledObjectRef(name=name, namespace=namespace, scalerMetadata=metadata)


def metric(stub: externalscaler_pb2_grpc.ExternalScalerStub, name: str) -> float:
    reply = stub.GetMetrics(externalscaler_pb2.GetMetricsRequest(scaledObjectRef=ref(name), metricName="s0-x"))
    value = reply.metricValues[0]
    assert value.metricValue == int(value.metricValueFloat)
    return float(value.metricValueFloat)


def wait_until(predicate: Callable[[], object], timeout: float, what: str, step: float = 0.05) -> float:
    """:func:`wait_for`, returning the seconds it took."""
    start = time.monotonic()
    wait_for(predicate, timeout, what, every=step)
    return time.monotonic() - start


class ScalerProcess:
    def __init__(self, tmp: Path, *extra: str, models: str = MODELS) -> None:
        self.tmp = tmp
        self.models_file = tmp / "models.yaml"
        self.models_file.write_text(models)
        self.token_file = tmp / "token"
        self.token_file.write_text("s3cret-token\n")
        self.demand = f"127.0.0.1:{free_port()}"
        self.keda = f"127.0.0.1:{free_port()}"
        self.admin = f"127.0.0.1:{free_port()}"
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = tmp / "scaler.log"
        self.start()

    def start(self) -> None:
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "wakegate",
                "scaler",
                "--models-file",
                str(self.models_file),
                "--demand-listen",
                self.demand,
                "--keda-listen",
                self.keda,
                "--admin-listen",
                self.admin,
                "--internal-token-file",
                str(self.token_file),
                *self.extra,
            ],
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        log.close()
        wait_until(lambda: "wakegate scaler: ready" in self.log()[offset:], 20, "scaler ready")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://{self.admin}/metrics", timeout=2) as resp:
            return str(resp.read().decode())

    def rejections(self, reason: str) -> float:
        return self.sample(f'wakegate_demand_rejections_total{{reason="{reason}"}}')

    def sample(self, series: str) -> float:
        """The value of one series (name and labels exactly as exported) on /metrics."""
        for line in self.metrics().splitlines():
            if line.startswith(series + " "):
                return float(line.split()[-1])
        raise AssertionError(f"no {series} on /metrics")

    def stop(self) -> int:
        assert self.proc is not None
        return stop_process(self.proc, timeout=15)

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.keda)


class Reporter:
    """A stand-in gateway process (tests/support/reporter.py)."""

    def __init__(self, scaler: ScalerProcess, gateway_id: str, model: str, in_flight: int, token: Path | None) -> None:
        argv = [sys.executable, "-m", "tests.support.reporter", scaler.demand, gateway_id, model, str(in_flight)]
        if token is not None:
            argv.append(str(token))
        self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def stop(self, sig: int) -> None:
        self.proc.send_signal(sig)
        self.proc.wait(10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


class Stream:
    """StreamIsActive in a thread; every value with its arrival time."""

    def __init__(self, stub: externalscaler_pb2_grpc.ExternalScalerStub, name: str) -> None:
        self.values: queue.Queue[tuple[bool, float]] = queue.Queue()
        self.call = stub.StreamIsActive(ref(name))
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for reply in self.call:
                self.values.put((reply.result, time.perf_counter()))
        except grpc.RpcError:
            return

    def next(self, timeout: float = 5.0) -> tuple[bool, float]:
        return self.values.get(timeout=timeout)

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(5)
