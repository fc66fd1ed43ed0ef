"""Cluster chaos on the real control plane: each component killed in turn under steady warm traffic.

The cluster form of wakegate runs as the other e2e modules run it (e2e/gateway.py): the operator,
`wakegate scaler` (builtin engine), and a gateway of `wakegate xds` + extproc + Envoy rendered from
the chart's bootstrap template, reporting demand to the scaler. One scale-to-zero sim Model is
kept warm by a prober sending one small chat request after another through the gateway.

Then, one at a time, a component is killed with SIGKILL and started again a second later, as
the kubelet restarts a crashed container: the operator, the feeder, the scaler, the
kube-apiserver (etcd kept), the feeder again while the apiserver is down, the gateway's extproc,
the gateway's Envoy, and the Model's backend pod (its process killed; the node agent restarts
the container); the apiserver's two faults come last. Any of our components that
exits by itself meanwhile (the operator leaves when it cannot renew its Lease) is restarted the
same way. Per fault it records the warm requests that did not get a 200, the time from the kill
to the end of the last failed one, and the time until the component was back (its readiness).

The target (docs/reliability.md, "On a cluster"): no failed warm request for an operator,
feeder, scaler or apiserver restart (nor a feeder restarted during an apiserver outage: it serves
nothing until its watches hold what the cluster has), nor for an extproc restart (the gateway
replays what no backend saw). An Envoy or backend death fails what was in flight there and recovers.

Opt-in: 1.5-3 minutes besides the cluster's start on two loaded cores (the scaler's Lease and
the apiserver's restarts take most of it), more than an e2e module may add to CI. The table of
docs/reliability.md comes from

    WAKEGATE_E2E_CHAOS=1 python -m pytest e2e/test_chaos.py -q -s

(`-s` shows the table; WAKEGATE_E2E_CHAOS_OUT=FILE also writes every record there as JSON;
WAKEGATE_E2E_CHAOS_ONLY=COMPONENT,... runs only those faults, by the table's component names).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

from e2e.cluster import Cluster
from e2e.gateway import Gateway, Operator, Scaler, post_json
from e2e.helpers import Kube, is_ready, pod_pid
from e2e.procs import Proc, kill_group
from e2e.test_operator import apply, model_yaml, wait_phase
from e2e.test_operator import wg as wg  # the namespace with the CRDs installed
from tests.support.waiting import wait_for
from wakegate.control.admin import free_port

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.environ.get("WAKEGATE_E2E_CHAOS") != "1", reason="opt-in: WAKEGATE_E2E_CHAOS=1"),
]

MODEL = "steady"
#: How long a killed component stays down before it is started again (a kubelet restart).
RESTART_AFTER = 1.0
#: How long the apiserver stays down while the feeder restarts.
OUTAGE_SECONDS = 8.0
#: After a fault: every probe must succeed for this long before the next fault.
SETTLE_SECONDS = 3.0
#: Well inside what the replay's retries wait for a restarted extproc.
REPLAY_WAIT_SECONDS = 6.0
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@dataclass
class Probe:
    start: float
    end: float
    ok: bool
    what: str


class Prober:
    """One warm chat request after another through the gateway, every outcome kept."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.probes: list[Probe] = []
        #: When the probe under way started (None between probes).
        self.in_flight: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = self.in_flight = time.monotonic()
            try:
                status, body = post_json(f"{self.url}/v1/chat/completions", CHAT, timeout=60)
                ok, what = status == 200, f"{status} {json.dumps(body)[:160]}"
            except OSError as exc:
                ok, what = False, type(exc).__name__
            self.probes.append(Probe(started, time.monotonic(), ok, what))
            self.in_flight = None
            time.sleep(0.05)

    def steady(self) -> bool:
        """Every probe started in the last SETTLE_SECONDS succeeded (at least one did), and none
        older is still waiting for its answer."""
        since = time.monotonic() - SETTLE_SECONDS
        after = [p for p in self.probes if p.start >= since]
        waiting = self.in_flight
        return bool(after) and all(p.ok for p in after) and (waiting is None or waiting >= since)

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(70)


class Keeper:
    """Starts again any of our components that exits by itself (a Deployment's restart), counting it."""

    def __init__(self, procs: list[Proc]) -> None:
        self.procs = procs
        self.restarts: dict[str, int] = {}
        self.paused: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for proc in self.procs:
                if proc.name not in self.paused and proc.exited() is not None:
                    self.restarts[proc.name] = self.restarts.get(proc.name, 0) + 1
                    time.sleep(RESTART_AFTER)
                    proc.start()

    def __enter__(self) -> Keeper:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)


@dataclass
class Record:
    component: str
    fault: str
    probes: int = 0
    failed: int = 0
    #: From the kill to the end of the last failed probe (0: none failed).
    recovery_seconds: float = 0.0
    #: From the kill until the component answered its readiness check again.
    back_seconds: float = 0.0
    slowest_probe_seconds: float = 0.0
    failures: list[str] = field(default_factory=list)
    #: Components that exited by themselves during this fault and were restarted.
    exited: dict[str, int] = field(default_factory=dict)


def _get(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return str(resp.read().decode(errors="replace"))
    except OSError:
        return ""


def restart(keeper: Keeper, proc: Proc) -> None:
    """SIGKILL the component's process group, reap it, start it again after RESTART_AFTER."""
    keeper.paused.add(proc.name)
    try:
        kill_group(proc.pid, signal.SIGKILL)
        assert proc.popen is not None
        proc.popen.wait(10)
        time.sleep(RESTART_AFTER)
        proc.start()
    finally:
        keeper.paused.discard(proc.name)


def feeder_during_outage(keeper: Keeper, apiserver: Proc, feeder: Proc) -> None:
    """The apiserver dies, then the feeder restarts while it is down (a node reboot in an outage):
    the restarted feeder cannot list anything until the apiserver is back."""
    keeper.paused.add(apiserver.name)
    kill_group(apiserver.pid, signal.SIGKILL)
    assert apiserver.popen is not None
    apiserver.popen.wait(10)
    restart(keeper, feeder)
    # From this (the main) thread: a process is killed when the thread that started it ends.
    time.sleep(OUTAGE_SECONDS)
    apiserver.start()
    keeper.paused.discard(apiserver.name)


def _backends(kube: Kube) -> dict[str, int]:
    """Ready backend pods of the Model -> their container restarts."""
    return {
        p.metadata.name: sum(c.restart_count or 0 for c in p.status.container_statuses or [])
        for p in kube.pods(f"wakegate.io/model={MODEL}")
        if is_ready(p) and not p.metadata.deletion_timestamp
    }


def kill_backend(kube: Kube) -> dict[str, int]:
    """SIGKILL the process of a ready backend pod; the Model's ready pods and restarts before it."""
    ready = _backends(kube)
    pod = kube.pod(next(iter(ready)))
    os.kill(pod_pid(pod), signal.SIGKILL)
    return ready


def backend_back(kube: Kube, before: dict[str, int]) -> bool:
    """A backend pod is Ready again after the kill: its container restarted, or a new pod."""
    return any(before.get(name, -1) < restarts for name, restarts in _backends(kube).items())


def run_fault(
    prober: Prober, keeper: Keeper, component: str, fault: str, act: Callable[[], None], back: Callable[[], object]
) -> Record:
    before = dict(keeper.restarts)
    wait_for(prober.steady, 90, f"steady warm answers before {component}")
    at = time.monotonic()
    act()
    back_at = wait_for(lambda: time.monotonic() if back() else 0.0, 120, f"{component} back", every=0.1)
    # Steady again: only probes sent after the component came back count as its recovery.
    wait_for(
        lambda: time.monotonic() - back_at >= SETTLE_SECONDS and prober.steady(),
        120,
        f"steady warm answers after {component}",
    )
    after = [p for p in prober.probes if p.end >= at]
    failed = [p for p in after if not p.ok]
    return Record(
        component=component,
        fault=fault,
        probes=len(after),
        failed=len(failed),
        recovery_seconds=round(max(p.end for p in failed) - at, 2) if failed else 0.0,
        back_seconds=round(back_at - at, 2),
        slowest_probe_seconds=round(max((p.end - p.start for p in after), default=0.0), 2),
        failures=sorted({p.what for p in failed})[:5],
        exited={k: v - before.get(k, 0) for k, v in keeper.restarts.items() if v != before.get(k, 0)},
    )


def table(records: list[Record]) -> str:
    lines = [
        "| component | fault | warm requests failed | recovered after (s) | component back after (s) "
        "| slowest warm request (s) |",
        "|---|---|---|---|---|---|",
    ]
    for r in records:
        exited = f" (also restarted: {r.exited})" if r.exited else ""
        lines.append(
            f"| {r.component} | {r.fault}{exited} | {r.failed} of {r.probes} | {r.recovery_seconds:g} "
            f"| {r.back_seconds:g} | {r.slowest_probe_seconds:g} |"
        )
    return "\n".join(lines)


@contextmanager
def components(wg: Kube, tmp: Path) -> Iterator[tuple[Operator, Scaler, Gateway, str]]:
    demand = f"127.0.0.1:{free_port()}"
    gateway = Gateway(tmp, wg.cluster.kubeconfig, demand=demand)
    scaler = Scaler(tmp, wg.cluster.kubeconfig, wg.ns, gateway.token, demand)
    operator_admin = f"127.0.0.1:{free_port()}"
    operator = Operator(
        tmp, wg.cluster.kubeconfig, wg.ns, "operator", ["--renew-seconds", "1", "--admin-listen", operator_admin]
    )
    started: list[Operator | Scaler | Gateway] = []
    try:
        for thing in (operator, gateway, scaler):
            thing.start()
            started.append(thing)
        yield operator, scaler, gateway, operator_admin
    finally:
        for thing in reversed(started):
            thing.stop()


def _apiserver(cluster: Cluster) -> Proc | None:
    return next((p for p in cluster.procs if p.name == "kube-apiserver"), None)


def test_each_component_killed_under_warm_traffic(wg: Kube, tmp_path: Path) -> None:
    spec = {"scaling": {"min": 0, "max": 1, "engine": "builtin", "idleTimeout": 20, "activationTimeout": 60}}
    records: list[Record] = []
    with components(wg, tmp_path) as (operator, scaler, gateway, operator_admin):
        wait_for(scaler.leads, 30, "the scaler to hold its Lease")
        apply(wg, model_yaml(MODEL, **spec))
        wait_phase(wg, MODEL, "Idle")
        procs = [operator.proc, scaler.proc, *gateway.procs]
        apiserver = _apiserver(wg.cluster)
        with Prober(gateway.url) as prober, Keeper(procs) as keeper:
            wait_for(prober.steady, 120, "the Model to wake and serve")
            extproc_admin = f"http://127.0.0.1:{gateway.extproc_admin}"
            faults: list[tuple[str, str, Callable[[], None], Callable[[], object]]] = [
                (
                    "operator",
                    "kill -9, restart after 1 s",
                    lambda: restart(keeper, operator.proc),
                    lambda: '"leader": true' in _get(f"http://{operator_admin}/healthz"),
                ),
                (
                    "feeder (`wakegate xds`)",
                    "kill -9, restart after 1 s",
                    lambda: restart(keeper, gateway.xds),
                    lambda: _get(f"http://127.0.0.1:{gateway.xds_admin}/healthz"),
                ),
                ("scaler", "kill -9, restart after 1 s", lambda: restart(keeper, scaler.proc), scaler.leads),
            ]
            faults += [
                (
                    "gateway: extproc",
                    "kill -9, restart after 1 s",
                    lambda: restart(keeper, gateway.extproc),
                    lambda: _get(f"{extproc_admin}/healthz"),
                ),
                (
                    "gateway: Envoy",
                    "kill -9, restart after 1 s",
                    lambda: restart(keeper, gateway.envoy),
                    lambda: _get(f"http://127.0.0.1:{gateway.envoy_admin}/ready"),
                ),
            ]
            before: dict[str, int] = {}
            faults.append(
                (
                    "backend pod (the only replica)",
                    "kill -9 of its process; the node agent restarts it",
                    lambda: before.update(kill_backend(wg)),
                    lambda: backend_back(wg, before),
                ),
            )
            # The apiserver last: after its restarts kube-controller-manager's EndpointSlice
            # informer can lag for tens of seconds ("informer cache is out of date"), which would
            # show in the backend row rather than in its own.
            if apiserver is not None:  # a cluster attached with --cluster-dir is not ours to restart

                def apiserver_ready() -> bool:
                    return wg.cluster._get(f"{wg.cluster.server}/readyz") == "ok"

                faults += [
                    (
                        "kube-apiserver",
                        "kill -9, restart after 1 s (etcd kept)",
                        lambda: restart(keeper, apiserver),
                        apiserver_ready,
                    ),
                    (
                        "feeder while the apiserver is down",
                        f"kill -9 the apiserver, restart the feeder, the apiserver {OUTAGE_SECONDS:g} s later",
                        lambda: feeder_during_outage(keeper, apiserver, gateway.xds),
                        lambda: apiserver_ready() and _get(f"http://127.0.0.1:{gateway.xds_admin}/healthz"),
                    ),
                ]
            chosen = os.environ.get("WAKEGATE_E2E_CHAOS_ONLY", "")  # a comma-separated subset, by component
            if chosen:
                faults = [f for f in faults if f[0] in chosen.split(",")]
            for component, fault, act, back in faults:
                records.append(run_fault(prober, keeper, component, fault, act, back))
                print(json.dumps(asdict(records[-1])), flush=True)
    print("\n" + table(records))
    out = os.environ.get("WAKEGATE_E2E_CHAOS_OUT")
    if out:
        Path(out).write_text(json.dumps([asdict(r) for r in records], indent=1))
    by_name = {r.component: r for r in records}
    for name in (
        "operator",
        "feeder (`wakegate xds`)",
        "scaler",
        "kube-apiserver",
        "feeder while the apiserver is down",
    ):
        if name in by_name:
            assert by_name[name].failed == 0, (by_name[name], table(records))
    # Replayed requests wait for the restarted extproc as long as the replay's retries last
    # (REPLAY_ATTEMPTS back-offs, about 8 s); an extproc that took longer to start fails them.
    extproc = by_name.get("gateway: extproc")
    if extproc is not None and extproc.back_seconds < REPLAY_WAIT_SECONDS:
        assert extproc.failed == 0, (extproc, table(records))
    # An Envoy or backend death fails what it had in flight, and then recovers.
    for record in records:
        assert record.recovery_seconds < 60, (record, table(records))
