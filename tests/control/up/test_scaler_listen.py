"""`wakegate up --scaler-listen`: KEDA's protocol for local models, driven by a real cold request."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.support.http import request
from tests.support.scaler import Stream, ref, wait_until
from tests.support.up import UpProcess, model_doc
from wakegate.control.admin import free_port
from wakegate.externalscaler import externalscaler_pb2_grpc

MODELS = model_doc(
    "lazy",
    extra="""  args: [--startup-seconds, "0.2"]
  scaling: {min: 0, max: 2, idleTimeout: 2, targetInFlight: 1}
""",
)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[UpProcess, str]]:
    address = f"127.0.0.1:{free_port()}"
    proc = UpProcess(tmp_path_factory.mktemp("up-scaler"), MODELS, "--scaler-listen", address)
    try:
        proc.wait_ready({}, timeout=60)
        yield proc, address
    finally:
        assert proc.stop() == 0, proc.log()


def cold_request(up: UpProcess, out: list[int]) -> None:
    body = {"model": "lazy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    out.append(request("POST", f"{up.base_url}/chat/completions", body=body, timeout=30).status)


def test_cold_request_streams_active_within_50ms(up: tuple[UpProcess, str], tmp_path: Path) -> None:
    gateway, address = up
    with grpc.insecure_channel(address) as channel:
        stub = externalscaler_pb2_grpc.ExternalScalerStub(channel)
        # Locally the ScaledObjectRef names the model without a namespace.
        assert stub.IsActive(ref("lazy", namespace="")).result is False
        stream = Stream(stub, "lazy")
        try:
            assert stream.next()[0] is False
            statuses: list[int] = []
            sent = time.perf_counter()
            thread = threading.Thread(target=cold_request, args=(gateway, statuses))
            thread.start()
            active, at = stream.next()
            assert active is True
            assert at - sent < 0.05, f"StreamIsActive true {(at - sent) * 1000:.1f} ms after the cold request"
            thread.join(30)
            assert statuses == [200]
            spec = stub.GetMetricSpec(ref("lazy", namespace="")).metricSpecs[0]
            assert spec.targetSize == 1 and spec.targetSizeFloat == 1.0
            # Back to inactive once idle for idleTimeout (2 s) after the request finished.
            active, _ = stream.next(timeout=10)
            assert active is False
            wait_until(lambda: not stub.IsActive(ref("lazy", namespace="")).result, 1, "inactive")
        finally:
            stream.close()
