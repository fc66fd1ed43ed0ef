"""`wakegate scaler` driven over the wire by a client generated from KEDA's own externalscaler.proto."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from e2e.pki import PKI
from tests.support.scaler import Reporter, ScalerProcess, Stream, metric, ref, wait_until
from wakegate.externalscaler import externalscaler_pb2_grpc
from wakegate.v1 import demand_pb2, demand_pb2_grpc

TOKEN = (("authorization", "Bearer s3cret-token"),)


@pytest.fixture(scope="module")
def scaler(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScalerProcess]:
    proc = ScalerProcess(tmp_path_factory.mktemp("scaler"))
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


def report(gw: str, seq: int, instance: str = "i", **queued: int) -> demand_pb2.DemandReport:
    models = [demand_pb2.ModelDemand(model=f"ns/{k}", queued=v) for k, v in queued.items()]
    return demand_pb2.DemandReport(gateway_id=gw, instance=instance, sequence=seq, models=models)


def test_every_rpc_and_stream_latency(scaler: ScalerProcess) -> None:
    with scaler.channel() as keda, grpc.insecure_channel(scaler.demand) as gw:
        stub = externalscaler_pb2_grpc.ExternalScalerStub(keda)
        demand = demand_pb2_grpc.DemandServiceStub(gw)
        for name, meta in (("wg-m", {}), ("m", {}), ("anything", {"model": "m"}), ("x", {"model": "ns/m"})):
            assert stub.IsActive(ref(name, **meta)).result is False
        spec = stub.GetMetricSpec(ref("wg-m")).metricSpecs[0]
        assert (spec.metricName, spec.targetSize, spec.targetSizeFloat) == ("wakegate-demand", 4, 4.0)
        assert metric(stub, "wg-m") == 0
        with pytest.raises(grpc.RpcError) as err:
            stub.IsActive(ref("wg-nope"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

        stream = Stream(stub, "wg-m")
        try:
            assert stream.next()[0] is False, "current state first"
            sent = time.perf_counter()
            assert demand.Report(report("gw-a", 1, m=3), metadata=TOKEN).accepted
            active, at = stream.next()
            assert active is True
            assert at - sent < 0.05, f"StreamIsActive true after {(at - sent) * 1000:.1f} ms"
            assert stub.IsActive(ref("wg-m")).result is True
            assert metric(stub, "wg-m") == 3
            assert demand.Report(report("gw-b", 1, m=6), metadata=TOKEN).accepted
            assert metric(stub, "wg-m") == 9  # 9 / targetInFlight 4 -> 3 replicas in KEDA's HPA
            # Withdrawals: no demand, then false after idleTimeout (2 s).
            for gw_id in ("gw-a", "gw-b"):
                withdraw = demand_pb2.DemandReport(gateway_id=gw_id, instance="i", sequence=2, withdraw=True)
                assert demand.Report(withdraw, metadata=TOKEN).accepted
            assert metric(stub, "wg-m") == 0
            idle_from = time.perf_counter()
            active, at = stream.next()
            assert active is False and 1.9 < at - idle_from < 2.5
            # A reconnecting KEDA gets the state at once.
            again = Stream(stub, "wg-m")
            assert again.next()[0] is False
            again.close()
        finally:
            stream.close()


def test_gpu_group_loser_is_inactive(scaler: ScalerProcess) -> None:
    with scaler.channel() as keda, grpc.insecure_channel(scaler.demand) as gw:
        stub = externalscaler_pb2_grpc.ExternalScalerStub(keda)
        demand = demand_pb2_grpc.DemandServiceStub(gw)
        assert demand.Report(report("gw-g", 1, big=1, small=2), metadata=TOKEN).accepted
        assert stub.IsActive(ref("wg-big")).result is True
        assert stub.IsActive(ref("wg-small")).result is False
        assert metric(stub, "wg-small") == 0
        withdraw = demand_pb2.DemandReport(gateway_id="gw-g", instance="i", sequence=2, withdraw=True)
        assert demand.Report(withdraw, metadata=TOKEN).accepted


def test_rejections_are_counted(scaler: ScalerProcess) -> None:
    with grpc.insecure_channel(scaler.demand) as gw:
        demand = demand_pb2_grpc.DemandServiceStub(gw)
        before = {r: scaler.rejections(r) for r in ("unauthenticated", "stale", "oversized")}
        refused = 'wakegate_internal_auth_refused_total{service="demand"}'
        refused_before = scaler.sample(refused)
        for metadata in ((("authorization", "Bearer forged"),), ()):
            with pytest.raises(grpc.RpcError) as err:
                demand.Report(report("gw-x", 1, m=1), metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert demand.Report(report("gw-x", 5, m=1), metadata=TOKEN).accepted
        replay = demand.Report(report("gw-x", 5, m=1000), metadata=TOKEN)
        assert not replay.accepted and "stale" in replay.reason
        oversized = demand.Report(report("gw-x", 6, m=2_000_000), metadata=TOKEN)
        assert not oversized.accepted
        huge = demand_pb2.DemandReport(
            gateway_id="gw-x",
            instance="i",
            sequence=7,
            models=[demand_pb2.ModelDemand(model=f"ns/m{i}", queued=1) for i in range(10_001)],
        )
        assert not demand.Report(huge, metadata=TOKEN).accepted
        withdraw = demand_pb2.DemandReport(gateway_id="gw-x", instance="i", sequence=8, withdraw=True)
        assert demand.Report(withdraw, metadata=TOKEN).accepted
        after = {r: scaler.rejections(r) for r in before}
        assert after["unauthenticated"] - before["unauthenticated"] == 2
        # The series the WakegateInternalAuthRefused alert reads, as `wakegate xds` exports it.
        assert scaler.sample(refused) - refused_before == 2
        assert after["stale"] - before["stale"] == 1
        assert after["oversized"] - before["oversized"] == 2


def test_three_gateways_sum_expire_and_restart(tmp_path: Path) -> None:
    scaler = ScalerProcess(tmp_path)
    gateways = [Reporter(scaler, f"gw-{i}", "ns/m", n, scaler.token_file) for i, n in enumerate((1, 2, 4))]
    try:
        with scaler.channel() as keda:
            stub = externalscaler_pb2_grpc.ExternalScalerStub(keda)
            wait_until(lambda: metric(stub, "wg-m") == 7, 10, "sum of three gateways")
        # Memory only: a restarted scaler is rebuilt by the next round of reports (every 2 s).
        assert scaler.stop() == 0
        scaler.start()
        with scaler.channel() as keda:
            stub = externalscaler_pb2_grpc.ExternalScalerStub(keda)
            took = wait_until(lambda: metric(stub, "wg-m") == 7, 5, "state rebuilt after restart")
            assert took < 2.5
            gateways[1].stop(signal.SIGTERM)  # shuts down: withdraws its share
            assert wait_until(lambda: metric(stub, "wg-m") == 5, 2, "withdrawal") < 1.0
            killed = time.monotonic()
            gateways[2].stop(signal.SIGKILL)  # no withdrawal: its share expires
            wait_until(lambda: metric(stub, "wg-m") == 1, 14, "expiry of the killed gateway", step=0.1)
            gone = time.monotonic() - killed
            assert 7.5 < gone < 12.5, f"expired after {gone:.1f}s"
    finally:
        for gateway in gateways:
            if gateway.proc.poll() is None:
                gateway.stop(signal.SIGKILL)
        assert scaler.stop() == 0, scaler.log()


def test_mtls_on_the_keda_port(tmp_path: Path) -> None:
    pki = PKI(tmp_path / "pki")
    server = pki.issue("server", "wakegate-scaler", server=True)
    client = pki.issue("keda", "keda-operator")
    scaler = ScalerProcess(
        tmp_path,
        "--tls-cert",
        str(server.cert),
        "--tls-key",
        str(server.key),
        "--tls-client-ca",
        str(pki.ca.cert),
    )
    try:
        ca = pki.ca.cert.read_bytes()
        good = grpc.ssl_channel_credentials(ca, client.key.read_bytes(), client.cert.read_bytes())
        with grpc.secure_channel(scaler.keda, good) as channel:
            stub = externalscaler_pb2_grpc.ExternalScalerStub(channel)
            assert stub.IsActive(ref("wg-m"), timeout=5).result is False
        with grpc.secure_channel(scaler.keda, grpc.ssl_channel_credentials(ca)) as channel:
            stub = externalscaler_pb2_grpc.ExternalScalerStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.IsActive(ref("wg-m"), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        assert scaler.stop() == 0, scaler.log()
