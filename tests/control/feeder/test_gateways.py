"""The feeder of a real `wakegate up` (real Envoy, extproc, sim backends) with foreign ADS subscribers.

Endpoint gating follows each gateway's own acknowledgements: a subscriber that never
acknowledges again, or one that rejects everything, holds back nothing but itself. And the
feeder's port (ADS and demand on one gRPC server in `up`) refuses anyone without the
internal token, counts it and says so in one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.rpc import status_pb2

from tests.support.http import request
from tests.support.up import UpProcess, model_doc
from wakegate.control.feeder.envoy_types import CLUSTER as CLUSTER_TYPE
from wakegate.control.feeder.envoy_types import ENDPOINT, MODEL_ROUTE
from wakegate.control.feeder.routed import cluster_name
from wakegate.v1 import demand_pb2, demand_pb2_grpc, routing_pb2

FLEET = model_doc(
    "sleepy",
    extra="""  scaling: {min: 0, max: 1, idleTimeout: 2, activationTimeout: 60}
""",
)
CLUSTER = cluster_name("sleepy")


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    gateway = UpProcess(tmp_path_factory.mktemp("gateways"), FLEET)
    try:
        gateway.wait_ready({"sleepy": 0}, timeout=90)
        yield gateway
    finally:
        assert gateway.stop() == 0, gateway.log()


def feeder_address(up: UpProcess) -> str:
    """The feeder's port, as `up` told its Envoy (the bootstrap names it, never the token)."""
    config = yaml.safe_load((up.state_dir / "envoy.yaml").read_text())
    (xds,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "wakegate_xds"]
    address = xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    return f"{address['address']}:{address['port_value']}"


def token_file(up: UpProcess) -> Path:
    return up.state_dir / "secrets" / "internal-token"


class Subscriber:
    """A foreign ADS client: acknowledges its first response of each type, then behaves as told.

    silent: never answers again (a hung gateway); nack: rejects every later response; lagging:
    acknowledges everything until `frozen`, then nothing (a gateway that stalls mid-way, holding
    an endpoint it was given).
    """

    def __init__(self, channel: grpc.aio.Channel, node: str, mode: str, token: str | None) -> None:
        self.node = base_pb2.Node(id=node)
        self.mode = mode
        self.outgoing: asyncio.Queue[discovery_pb2.DiscoveryRequest] = asyncio.Queue()
        self.responses: list[discovery_pb2.DiscoveryResponse] = []
        self.acked: set[str] = set()
        self.frozen = False
        metadata = (("authorization", f"Bearer {token}"),) if token is not None else ()

        async def requests() -> AsyncIterator[discovery_pb2.DiscoveryRequest]:
            while True:
                yield await self.outgoing.get()

        self.call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(
            requests(), metadata=metadata
        )
        self.reader = asyncio.create_task(self._read())

    def subscribe(self, type_url: str, names: tuple[str, ...] = ()) -> None:
        self.outgoing.put_nowait(
            discovery_pb2.DiscoveryRequest(node=self.node, type_url=type_url, resource_names=list(names))
        )

    async def _read(self) -> None:
        async for response in self.call:
            self.responses.append(response)
            if response.type_url not in self.acked or (self.mode == "lagging" and not self.frozen):
                self.acked.add(response.type_url)
                self._answer(response, version_info=response.version_info)
            elif self.mode == "nack":
                self._answer(response, error_detail=status_pb2.Status(code=3, message="rejected by a test subscriber"))

    def _answer(self, response: discovery_pb2.DiscoveryResponse, **fields: object) -> None:
        self.outgoing.put_nowait(
            discovery_pb2.DiscoveryRequest(
                node=self.node,
                type_url=response.type_url,
                resource_names=[CLUSTER] if response.type_url == ENDPOINT else [],
                response_nonce=response.nonce,
                **fields,  # type: ignore[arg-type]
            )
        )

    def endpoints_seen(self, type_url: str) -> list[int]:
        """How many endpoints of the model each response of this type carried."""
        counts = []
        for response in self.responses:
            if response.type_url != type_url:
                continue
            for packed in response.resources:
                if type_url == MODEL_ROUTE:
                    route = routing_pb2.ModelRoute()
                    packed.Unpack(route)
                    counts.append(len(route.endpoints))
                else:
                    assignment = endpoint_pb2.ClusterLoadAssignment()
                    packed.Unpack(assignment)
                    counts.append(sum(len(locality.lb_endpoints) for locality in assignment.endpoints))
        return counts


def chat(up: UpProcess, timeout: float = 90.0) -> int:
    body = {"model": "sleepy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return request("POST", f"{up.base_url}/chat/completions", body=body, timeout=timeout).status


async def wait_idle(up: UpProcess, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        (model,) = up.status()["models"]
        if model["ready"] == 0 and not model["replicas"]:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"the model did not scale to zero: {up.status()}")


async def test_silent_and_rejecting_subscribers_do_not_hold_back_the_gateway(up: UpProcess) -> None:
    token = token_file(up).read_text().strip()
    async with grpc.aio.insecure_channel(feeder_address(up)) as channel:
        foreign = [
            Subscriber(channel, "silent-gateway", "silent", token),
            Subscriber(channel, "nack-gateway", "nack", token),
            Subscriber(channel, "lagging-gateway", "lagging", token),
        ]
        for subscriber in foreign:
            # An Envoy's subscriptions and an extproc's, on one stream: both directions of gating.
            subscriber.subscribe(CLUSTER_TYPE)
            subscriber.subscribe(ENDPOINT, (CLUSTER,))
            subscriber.subscribe(MODEL_ROUTE)
        deadline = time.monotonic() + 20
        while any(len(s.acked) < 3 for s in foreign) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert all(len(s.acked) == 3 for s in foreign), [s.responses for s in foreign]

        # Two are on record with no endpoint acknowledged. A cold request wakes the model: its
        # endpoint must reach this gateway's extproc on its own Envoy's word alone.
        lagging = foreign[2]
        for round in range(2):
            statuses = await asyncio.gather(*(asyncio.to_thread(chat, up) for _ in range(3)))
            assert statuses == [200, 200, 200], up.log()
            assert [await asyncio.to_thread(chat, up) for _ in range(8)] == [200] * 8
            if round == 0:
                # The lagging "gateway" took the endpoint into its routes, then stalls: it will
                # never acknowledge the endpoint's removal.
                deadline = time.monotonic() + 20
                while 1 not in lagging.endpoints_seen(MODEL_ROUTE) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert 1 in lagging.endpoints_seen(MODEL_ROUTE)
                lagging.frozen = True
            # Back to zero. The next wake gets a new backend port; had the old endpoint stayed in
            # this gateway's Envoy for the lagging one's sake, some requests would hit it (503).
            await wait_idle(up)

        # The rejecting subscriber was sent the endpoint changes and refused each; the silent one
        # got one change it never answered, and nothing after. Both streams are still open, and
        # their own routes stay without the endpoint their "Envoy" never confirmed.
        silent, nack, _ = foreign
        assert nack.endpoints_seen(ENDPOINT)[0] == 0 and max(nack.endpoints_seen(ENDPOINT)) == 1
        assert len(nack.endpoints_seen(ENDPOINT)) >= 3, nack.endpoints_seen(ENDPOINT)
        assert silent.endpoints_seen(ENDPOINT) in ([0], [0, 1]), silent.endpoints_seen(ENDPOINT)
        assert set(silent.endpoints_seen(MODEL_ROUTE)) == set(nack.endpoints_seen(MODEL_ROUTE)) == {0}
        # The lagging one's own Envoy view kept the old endpoint beside the new one; ours did not.
        assert max(lagging.endpoints_seen(ENDPOINT)) == 2, lagging.endpoints_seen(ENDPOINT)
        assert not any(s.reader.done() for s in foreign)
        for subscriber in foreign:
            subscriber.call.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await subscriber.reader
    assert "xds NACK node=nack-gateway" in all_logs(up)
    # The real gateway is one node: its Envoy and its extproc subscribed under one id, so its
    # extproc was gated by its Envoy (not left ungated under an id no Envoy has).
    opened = re.findall(r"xds stream opened node=(\S+)", all_logs(up))
    own = [node for node in opened if not node.endswith("-gateway")]
    assert len(set(own)) == 1 and len(own) >= 2, opened


def all_logs(up: UpProcess) -> str:
    """`up`'s own log and its feeder's (the ADS server runs in the feeder process)."""
    feeder = up.state_dir / "logs" / "feeder.log"
    return up.log() + (feeder.read_text(errors="replace") if feeder.exists() else "")


def refused(up: UpProcess) -> dict[str, float]:
    text = request("GET", f"http://127.0.0.1:{up.admin_port}/metrics").text
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'^wakegate_internal_auth_refused_total\{service="(\w+)"\} (\S+)$', text, re.M)
    }


async def test_subscribers_and_reporters_without_the_token_are_refused_and_counted(up: UpProcess) -> None:
    before = refused(up)
    async with grpc.aio.insecure_channel(feeder_address(up)) as channel:
        for token in (None, "not-the-token"):
            subscriber = Subscriber(channel, f"stranger-{token}", "silent", token)
            subscriber.subscribe(MODEL_ROUTE)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await asyncio.wait_for(subscriber.reader, 10)
            assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert subscriber.responses == []
    async with grpc.aio.insecure_channel(up.child_arg("extproc-0", "--demand")) as channel:
        stub = demand_pb2_grpc.DemandServiceStub(channel)
        report = demand_pb2.DemandReport(
            gateway_id="stranger", instance="x", sequence=1, models=[demand_pb2.ModelDemand(model="sleepy", queued=50)]
        )
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.Report(report, timeout=10)
        assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # The feeder process reports its refusals to `up` within a fraction of a second.
    deadline = time.monotonic() + 10
    after = refused(up)
    while after["ads"] - before.get("ads", 0) < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        after = refused(up)
    assert after["ads"] - before.get("ads", 0) == 2
    assert after["demand"] - before.get("demand", 0) == 1
    # The fake demand changed nothing: no replica was started for it.
    await asyncio.sleep(1)
    assert up.status()["models"][0]["replicas"] == []
    # One concise line per burst, never a traceback, never the token.
    log = all_logs(up)
    assert 1 <= log.count("refused unauthenticated") <= 2, log
    assert "Traceback" not in log
    token = token_file(up).read_text().strip()
    assert token not in log


def test_the_token_is_owner_only_and_in_no_command_line(up: UpProcess) -> None:
    path = token_file(up)
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    token = path.read_bytes().strip()
    assert len(token) >= 32
    seen = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        seen += 1
        assert token not in cmdline, f"pid {entry.name}"
    assert seen > 3
    # Envoy's bootstrap names the file, not the secret.
    assert token.decode() not in (up.state_dir / "envoy.yaml").read_text()
    assert os.fspath(path) in (up.state_dir / "envoy.yaml").read_text()
