"""`wakegate operator`: wait for the leader Lease, then run Kopf and the reconcile workers while leading.

A replica that loses the Lease stops reconciling and exits non-zero (its
Deployment restarts it as a standby); a clean exit releases the Lease so a
standby takes over at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from wakegate.control import admin
from wakegate.control.delivery.registry import RegistrySettings
from wakegate.control.k8s import kopfing, names
from wakegate.control.k8s.client import Kube, add_kubeconfig, api_client
from wakegate.control.k8s.lease import LeaderLease, LeaseConfig, LeaseNamespaceMissing
from wakegate.control.operator import render as rnd
from wakegate.control.operator.controller import Reconciler
from wakegate.control.operator.metrics import OperatorMetrics
from wakegate.control.operator.watches import keda_installed, register
from wakegate.control.runtimes import shipped_runtimes
from wakegate.process import ProcessSettings, add_log_level, graceful_exit, host_port, settings_from, start

log = logging.getLogger("wakegate.operator")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_kubeconfig(parser)
    parser.add_argument(
        "--scaler-address",
        default="wakegate-scaler.wakegate-system.svc:9091",
        help="host:port of `wakegate scaler`, written into KEDA ScaledObjects",
    )
    parser.add_argument(
        "--keda-auth-secret",
        default=None,
        metavar="NAME",
        help="Secret in each Model's namespace with KEDA's client certificate for the scaler's mTLS "
        "(tls.crt, tls.key, ca.crt): each keda Model gets a TriggerAuthentication naming it; unset: plaintext",
    )
    parser.add_argument(
        "--lease-namespace",
        default=os.environ.get("POD_NAMESPACE", "wakegate-system"),
        help="namespace of the leader-election Lease ($POD_NAMESPACE or wakegate-system by default)",
    )
    parser.add_argument("--lease-name", default="wakegate-operator")
    parser.add_argument("--lease-seconds", type=float, default=15.0, help="a dead leader is replaced after this")
    parser.add_argument("--renew-seconds", type=float, default=5.0, help="how often the leader renews its Lease")
    parser.add_argument(
        "--identity",
        default=f"{os.environ.get('HOSTNAME', socket.gethostname())}-{os.getpid()}",
        help="this replica's name in the Lease",
    )
    parser.add_argument(
        "--workers", type=int, default=16,
        help="Models reconciled concurrently (each waits on the API server most of its time)",
    )
    parser.add_argument(
        "--admin-listen",
        default="",
        metavar="HOST:PORT",
        help="serve /metrics (replicas, cold starts, activation failures) and /healthz here; empty: off",
    )
    parser.add_argument(
        "--node-cache-dir",
        default=names.NODE_CACHE_DIR,
        help="the node agents' model cache on every node (their --cache-dir), mounted into "
        "`cache: node|prewarm` pods",
    )
    parser.add_argument(
        "--install-runtimes",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="apply the InferenceRuntimes shipped for each backend plugin when leading",
    )
    parser.add_argument(
        "--registry-ca-file",
        type=Path,
        default=None,
        metavar="PEM",
        help="extra CA certificates trusted for the registries ModelCatalogs name",
    )
    parser.add_argument(
        "--native-path",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="the feeder lets Models take routing.path native (its own --native-path): status.routingPath "
        "says which path each Model takes; without it every Model reports decided",
    )
    add_log_level(parser)


@dataclass(frozen=True, kw_only=True)
class Settings(ProcessSettings):
    """Everything `wakegate operator` is configured with; built once from its command line."""

    kubeconfig: str | None
    """Where the cluster is (the seam's lookup order when None)."""
    scaler_address: str
    """host:port of `wakegate scaler`, written into KEDA ScaledObjects."""
    lease: LeaseConfig
    """The leader-election Lease and this replica's name in it."""
    workers: int
    """Models reconciled concurrently."""
    admin_listen: str = ""
    """HTTP address of /metrics and /healthz; empty: none served."""
    install_runtimes: bool
    """Apply the InferenceRuntimes shipped for each backend plugin when leading."""
    node_cache_dir: str = names.NODE_CACHE_DIR
    """The node agents' model cache directory on every node."""
    registry_ca_file: Path | None = None
    """Extra CA certificates for the registries ModelCatalogs name."""
    keda_auth_secret: str | None = None
    """Secret (per Model namespace) with KEDA's client certificate; None: KEDA dials in plaintext."""
    native_path: bool = False
    """The feeder lets Models take the native path (its --native-path): what status.routingPath says."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        lease = LeaseConfig(
            namespace=args.lease_namespace,
            name=args.lease_name,
            identity=args.identity,
            lease_seconds=args.lease_seconds,
            renew_seconds=args.renew_seconds,
        )
        if args.admin_listen:
            host_port(args.admin_listen, "0.0.0.0")
        return settings_from(cls, args, lease=lease)


async def _lead(args: Settings, kube: Kube, lease: LeaderLease, stop: asyncio.Event, metrics: OperatorMetrics) -> int:
    if args.install_runtimes:
        for runtime in shipped_runtimes():
            await asyncio.to_thread(kube.apply, runtime)
    keda = await asyncio.to_thread(keda_installed, kube)
    settings = rnd.Settings(
        scaler_address=args.scaler_address,
        keda_available=keda,
        node_cache_dir=args.node_cache_dir,
        keda_auth_secret=args.keda_auth_secret,
        native_path=args.native_path,
    )
    reconciler = Reconciler(kube, settings, workers=args.workers)
    reconciler.registry_settings = RegistrySettings(ca_file=args.registry_ca_file)
    reconciler.export_to(metrics)
    metrics.leader = True
    registry = kopfing.registry(args.kubeconfig)
    register(registry, reconciler)
    kopf_stop = asyncio.Event()
    tasks = {
        "kopf": asyncio.create_task(kopfing.run(registry, kopf_stop, signals=lambda: graceful_exit(stop, "operator"))),
        "workers": asyncio.create_task(reconciler.run()),
        "lease": asyncio.create_task(lease.keep()),
        "stop": asyncio.create_task(stop.wait()),
    }
    done, _ = await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_COMPLETED)
    kopf_stop.set()
    for name in ("workers", "lease", "stop"):
        tasks[name].cancel()
    with contextlib.suppress(asyncio.CancelledError, TimeoutError):
        await asyncio.wait_for(tasks["kopf"], 10)
    if tasks["lease"] in done:
        log.error("leadership lost; exiting so a standby can lead")
        return 1
    for task in done:
        if task is not tasks["stop"] and not task.cancelled() and task.exception() is not None:
            log.error("operator task failed: %r", task.exception())
            await asyncio.to_thread(lease.release)
            return 1
    await asyncio.to_thread(lease.release)
    return 0


async def _serve_admin(address: str, metrics: OperatorMetrics) -> web.AppRunner:
    async def scrape(_: web.Request) -> web.Response:
        return admin.metrics_response(metrics.registry)

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "leader": metrics.leader})

    host, port = host_port(address, "0.0.0.0")
    return await admin.serve({"/metrics": scrape, "/healthz": healthz}, host, port)


async def _main(args: Settings) -> int:
    metrics = OperatorMetrics()
    runner = await _serve_admin(args.admin_listen, metrics) if args.admin_listen else None
    try:
        return await _run(args, metrics)
    finally:
        if runner is not None:
            await runner.cleanup()


async def _run(args: Settings, metrics: OperatorMetrics) -> int:
    # Every API call runs in a thread: one per worker (and a few for the lease and start-up), where
    # asyncio's default pool would hold the workers to min(32, cores + 4) calls at once.
    threads = args.workers + 4
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(threads, thread_name_prefix="kube"))
    kube = Kube(api_client(args.kubeconfig, pool_size=threads))
    lease = LeaderLease(kube, args.lease)
    stop = asyncio.Event()
    graceful_exit(stop, "operator")
    log.info("operator %s waiting for lease %s/%s", args.lease.identity, args.lease.namespace, args.lease.name)
    acquire = asyncio.create_task(lease.acquire())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({acquire, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        acquire.cancel()
        return 0
    stopped.cancel()
    try:
        acquire.result()
    except LeaseNamespaceMissing as exc:
        log.error(
            "lease namespace %r does not exist: create it, or pass --lease-namespace (or set $POD_NAMESPACE) "
            "to a namespace that does (the chart's operator uses its release namespace)",
            exc.namespace,
        )
        return 2
    log.info("operator %s is the leader", args.lease.identity)
    return await _lead(args, kube, lease, stop, metrics)


def main(args: argparse.Namespace) -> int:
    return start(args, Settings.from_args, lambda settings: asyncio.run(_main(settings)), "operator", quiet=("kopf",))
