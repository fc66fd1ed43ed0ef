"""The native path on the real control plane: a warm round-robin Model routed by Envoy alone.

The gateway runs as the chart sets it up without API keys (`wakegate xds --native-path`, extproc
`--envoy-admin` counting its Envoy's native requests into its demand reports), the operator
with `--native-path` writes `status.routingPath`, and `wakegate scaler` (builtin engine) scales
the Model from the demand the gateway reports. Under steady load, an alias is added to the Model:
no request fails or is lost, the alias answers, and the Model is never scaled down while only
Envoy sees its requests; once the load stops it goes idle on time.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from e2e.gateway import Gateway, Operator, Scaler, post_json, running
from e2e.helpers import Kube
from e2e.test_operator import apply, get_model, kubectl, model_yaml, phase, wait_phase
from e2e.test_operator import wg as wg  # the namespace with the CRDs installed
from tests.support.http import EXTPROC_STREAMS, envoy_stat
from tests.support.waiting import wait_for
from wakegate.control.admin import free_port
from wakegate.extproc.cold import LEASE_GRACE_SECONDS

pytestmark = pytest.mark.e2e

IDLE_SECONDS = 4
#: Concurrent clients, each pausing between requests: ~100 requests/s in all.
WORKERS = 4
PAUSE_SECONDS = 0.04
CHAT = {"model": "nat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class Load:
    """Steady chat requests for one model through the gateway, every answer counted by status."""

    def __init__(self, url: str, model: str) -> None:
        self.url = url
        self.model = model
        self.sent = 0
        self.statuses: dict[int, int] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        body = {**CHAT, "model": self.model}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as session:

            async def worker() -> None:
                while not self._stop.is_set():
                    self.sent += 1
                    try:
                        async with session.post(f"{self.url}/v1/chat/completions", json=body) as response:
                            await response.read()
                            self.statuses[response.status] = self.statuses.get(response.status, 0) + 1
                    except (aiohttp.ClientError, TimeoutError) as exc:
                        self.statuses[0] = self.statuses.get(0, 0) + 1
                        self.errors.append(repr(exc))
                    await asyncio.sleep(PAUSE_SECONDS)

            await asyncio.gather(*(worker() for _ in range(WORKERS)))

    def __enter__(self) -> Load:
        self.started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(120)
        self.seconds = time.monotonic() - self.started


def _extproc_streams(gateway: Gateway) -> int:
    return envoy_stat(f"127.0.0.1:{gateway.envoy_admin}", EXTPROC_STREAMS, timeout=5)


def _status(kube: Kube, name: str) -> dict[str, Any]:
    return dict(get_model(kube, name).get("status") or {})


def test_alias_added_under_native_load_loses_nothing_and_demand_keeps_the_model_up(
    wg: Kube, tmp_path: Path
) -> None:
    demand = f"127.0.0.1:{free_port()}"
    gateway = Gateway(tmp_path, wg.cluster.kubeconfig, demand=demand, native=True)
    scaler = Scaler(tmp_path, wg.cluster.kubeconfig, wg.ns, gateway.token, demand)
    operator = Operator(tmp_path, wg.cluster.kubeconfig, wg.ns, "operator", ["--renew-seconds", "1", "--native-path"])
    spec: dict[str, Any] = {
        "routing": {"strategy": "round-robin", "path": "native"},
        "scaling": {"min": 0, "max": 1, "engine": "builtin", "idleTimeout": IDLE_SECONDS, "activationTimeout": 60},
    }

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.tail(20)}" for p in (operator.proc, scaler.proc, *gateway.procs))

    with running(operator, gateway, scaler):
        wait_for(scaler.leads, 30, "the scaler to hold its Lease")
        apply(wg, model_yaml("nat", **spec))
        wait_phase(wg, "nat", "Idle")
        assert _status(wg, "nat").get("routingPathReason") == "no ready endpoint"
        with Load(gateway.url, "nat") as load:
            # The first requests wake the Model (held by extproc); warm, Envoy routes it alone.
            wait_for(lambda: _status(wg, "nat").get("routingPath") == "native", 90, f"routingPath native\n{logs()}")
            wait_for(lambda: load.statuses.get(200, 0) > 0, 30, "a first answer")
            before = _extproc_streams(gateway)
            time.sleep(1)
            assert _extproc_streams(gateway) - before < 5, "warm requests still open ext_proc streams"
            pods = {p.metadata.name for p in wg.pods("wakegate.io/model=nat")}
            assert len(pods) == 1, pods
            # An alias is added: the route table changes under the load.
            assert gateway.chat("nat-alias", timeout=10)[0] == 404, "the alias is there before it is added"
            kubectl(wg, "patch", "model", "nat", "--type=merge", "-p", json.dumps({"spec": {"aliases": ["nat-alias"]}}))
            added = time.monotonic()
            wait_for(lambda: gateway.chat("nat-alias", timeout=10)[0] == 200, 30, f"the alias to answer\n{logs()}")
            alias_after = time.monotonic() - added
            # Only Envoy sees the load now: for longer than idleTimeout past the end of the wake's
            # activation lease (which counts as demand for a while after readiness), its counts
            # must keep the Model up (a scale-down would show as another pod, or none).
            busy_until = time.monotonic() + LEASE_GRACE_SECONDS + IDLE_SECONDS + 2
            replicas = set()
            while time.monotonic() < busy_until:
                replicas.add(int(wg.apps.read_namespaced_deployment_scale("wg-nat", wg.ns).spec.replicas or 0))
                time.sleep(0.3)
            assert {p.metadata.name for p in wg.pods("wakegate.io/model=nat")} == pods
        assert load.statuses == {200: load.sent}, (load.statuses, load.errors[:5])
        assert replicas == {1}, f"scaled while busy: {replicas}"
        status = _status(wg, "nat")
        assert status["routingPath"] == "native" and "routingPathReason" not in status, status
        assert "native" in kubectl(wg, "get", "models", "nat").stdout
        # The alias in the path needs no rewrite of the body: Envoy routes it alone too.
        by_path = post_json(f"{gateway.url}/model/nat-alias/v1/chat/completions", CHAT)
        assert by_path[0] == 200 and by_path[1]["model"] == "nat", by_path
        # The load stopped: the demand Envoy's counts carried ends, and the Model is released.
        stopped = time.monotonic()
        wait_phase(wg, "nat", "Idle", timeout=IDLE_SECONDS + 30)
        released = time.monotonic() - stopped
        wait_for(lambda: _status(wg, "nat").get("routingPath") == "decided", 30, "routingPath decided once idle")
        assert phase(wg, "nat") == "Idle"
        print(
            f"\n{load.sent} requests in {load.seconds:.1f}s ({load.sent / load.seconds:.0f}/s), all 200; "
            f"alias answered {alias_after:.1f}s after the patch; idle {released:.1f}s after the load"
        )
