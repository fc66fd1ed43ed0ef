"""`wakegate operator`: the Kubernetes operator for Model and InferenceRuntime (Kopf, leader-elected).

Importing this package is cheap: the Kopf machinery loads only in `main`.
render.py and status.py are pure; controller.py holds the watches and the
applies; run.py the process (leader election, Kopf lifecycle).
"""

from __future__ import annotations

import argparse
import os
import socket


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG, else in-cluster)")
    parser.add_argument(
        "--scaler-address",
        default="wakegate-scaler.wakegate-system.svc:9091",
        help="host:port of `wakegate scaler`, written into KEDA ScaledObjects",
    )
    parser.add_argument(
        "--lease-namespace",
        default=os.environ.get("POD_NAMESPACE", "wakegate-system"),
        help="namespace of the leader-election Lease (default: $POD_NAMESPACE or wakegate-system)",
    )
    parser.add_argument("--lease-name", default="wakegate-operator")
    parser.add_argument("--lease-seconds", type=float, default=15.0, help="a dead leader is replaced after this")
    parser.add_argument("--renew-seconds", type=float, default=5.0, help="how often the leader renews its Lease")
    parser.add_argument(
        "--identity",
        default=f"{os.environ.get('HOSTNAME', socket.gethostname())}-{os.getpid()}",
        help="this replica's name in the Lease",
    )
    parser.add_argument("--workers", type=int, default=4, help="Models reconciled concurrently")
    parser.add_argument(
        "--install-runtimes",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="apply the InferenceRuntimes shipped for each backend plugin when leading",
    )
    parser.add_argument("--log-level", default="info")


def main(args: argparse.Namespace) -> int:
    from control.operator.run import run

    return run(args)
