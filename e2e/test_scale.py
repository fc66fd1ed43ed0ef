"""A thousand Models at zero on the real control plane: operator, feeder and scaler at scale.

A scale run, skipped unless asked for (it takes minutes on two cores):

    WAKEGATE_E2E_SCALE_MODELS=1000 python -m pytest e2e/test_scale.py -s

One `kubectl apply` of N sim Models at `min: 0` (no pods: this measures the control plane, not
simulator start-up), with the operator, the scaler and a gateway (`wakegate xds` + extproc +
Envoy) running. It checks that every Model is reconciled (`phase: Idle`), that the gateway lists
every Model in `/v1/models`, and that one of them still wakes through the gateway; it prints how
long each took and the CPU and RSS of the operator, the feeder and the scaler (docs/performance.md).

With `WAKEGATE_E2E_SCALE_OPERATOR=after` the operator starts only once every Model exists, and
the time from its start until all are `Idle` is the operator's own reconcile time, apart from
how fast the API server takes the creates.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from e2e.gateway import XDS_RULES, Gateway, Operator, Scaler, install_crds, running, scoped_kubeconfig
from e2e.helpers import Kube
from e2e.test_operator import GROUP, VERSION, _proc_usage, model_yaml
from tests.support.waiting import wait_for
from wakegate.control.admin import free_port

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not os.environ.get("WAKEGATE_E2E_SCALE_MODELS"),
        reason="scale run: set WAKEGATE_E2E_SCALE_MODELS=1000",
    ),
]


def listed(gateway: Gateway) -> int:
    try:
        with urllib.request.urlopen(f"{gateway.url}/v1/models", timeout=10) as resp:
            return len(json.loads(resp.read())["data"])
    except OSError:
        return 0


def test_a_thousand_models_at_zero_reconcile_list_and_wake(kube: Kube, tmp_path: Path) -> None:
    count = int(os.environ["WAKEGATE_E2E_SCALE_MODELS"])
    install_crds(kube.api)
    with scoped_kubeconfig(kube, tmp_path, "xds", XDS_RULES) as readonly:
        demand = f"127.0.0.1:{free_port()}"
        gateway = Gateway(tmp_path, readonly, demand=demand)
        scaler = Scaler(tmp_path, kube.cluster.kubeconfig, kube.ns, gateway.token, demand)
        op = Operator(tmp_path, kube.cluster.kubeconfig, kube.ns, "operator", ["--renew-seconds", "1"])
        late = os.environ.get("WAKEGATE_E2E_SCALE_OPERATOR") == "after"
        with contextlib.ExitStack() as stack:
            stack.enter_context(running(scaler, gateway) if late else running(op, scaler, gateway))
            time.sleep(2)
            procs = {"operator": op.proc, "feeder": gateway.xds, "scaler": scaler.proc, "extproc": gateway.extproc}
            before = {name: 0.0 if late and name == "operator" else _proc_usage(p.pid)[0] for name, p in procs.items()}
            docs = [
                model_yaml(
                    f"m{i:04d}",
                    scaling={"engine": "builtin", "min": 0, "max": 1, "idleTimeout": 600},
                    args=["--drain-seconds", "0"],
                )
                for i in range(count)
            ]
            started = time.monotonic()
            # `kubectl create` (no read before each write) with time for a thousand objects.
            subprocess.run(
                ["kubectl", "--kubeconfig", str(kube.cluster.kubeconfig), "-n", kube.ns, "create", "-f", "-"],
                input="---\n".join(docs), capture_output=True, text=True, check=True, timeout=1200,
            )  # fmt: skip
            applied = time.monotonic() - started
            if late:
                stack.enter_context(running(op))
            op_started = time.monotonic()
            peak = dict.fromkeys(procs, 0)

            def all_idle() -> bool:
                for name, p in procs.items():
                    peak[name] = max(peak[name], _proc_usage(p.pid)[1])
                items = kube.custom.list_namespaced_custom_object(GROUP, VERSION, kube.ns, "models")["items"]
                return bool(sum((m.get("status") or {}).get("phase") == "Idle" for m in items) == count)

            wait_for(all_idle, 1800, f"{count} Models Idle", every=2)
            reconciled = time.monotonic() - started
            operator_s = time.monotonic() - op_started
            wait_for(lambda: listed(gateway) >= count, 600, f"{count} Models listed by the gateway", every=1)
            routed = time.monotonic() - started
            status, body = gateway.chat(f"m{count - 1:04d}", timeout=180)
            assert status == 200, body
            woke = time.monotonic() - started - routed
            usage = {name: _proc_usage(p.pid) for name, p in procs.items()}
            print(f"\n{count} Models at zero: kubectl apply {applied:.1f}s, all Idle after {reconciled:.1f}s "
                  f"({operator_s:.1f}s after the {'operator started' if late else 'apply ended'}), "
                  f"all listed by the gateway after {routed:.1f}s, one woken through it in {woke:.1f}s, "
                  f"load average {os.getloadavg()}")  # fmt: skip
            for name, (cpu, rss) in usage.items():
                print(
                    f"  {name}: CPU {cpu - before[name]:.1f}s, RSS {rss / 2**20:.0f} MiB "
                    f"(peak seen {max(peak[name], rss) / 2**20:.0f} MiB)"
                )
            subprocess.run(
                ["kubectl", "--kubeconfig", str(kube.cluster.kubeconfig), "-n", kube.ns, "delete", "models", "--all",
                 "--wait=false"],
                capture_output=True, check=False, timeout=600,
            )  # fmt: skip
