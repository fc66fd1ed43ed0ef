"""`wakegate scheduler-extender`: the kube-scheduler HTTP extender for GPU placement.

Serves `/filter` and `/score` (:mod:`wakegate.control.extender.server`) from in-memory mirrors of the
cluster's Nodes and the bench results ConfigMap (:mod:`wakegate.control.extender.kube`), with the
rules of :mod:`wakegate.control.placement.rules`. Score weights come from the `SCHED_*_WEIGHT`
environment variables; docs/placement.md has the scheduler configuration to use.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import threading
from dataclasses import dataclass

from aiohttp import web

from wakegate.control.extender.server import DEFAULT_MAX_BODY, make_app
from wakegate.control.k8s.client import Kube, add_kubeconfig, api_client
from wakegate.control.placement.benchdata import DEFAULT_CONFIGMAP
from wakegate.control.placement.rules import Weights
from wakegate.process import ProcessSettings, add_log_level, graceful_exit, host_port, settings_from, start

log = logging.getLogger("wakegate.extender")


def _host_port(value: str) -> tuple[str, int]:
    try:
        return host_port(value, "0.0.0.0")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--listen", type=_host_port, default=("0.0.0.0", 8888), metavar="HOST:PORT",
      help="address to serve the extender on (0.0.0.0:8888 by default)")
    add_kubeconfig(parser)
    a("--bench-namespace", default=os.environ.get("POD_NAMESPACE", "wakegate"),
      help="namespace of the bench results ConfigMap ($POD_NAMESPACE or wakegate by default)")
    a("--bench-configmap", default=DEFAULT_CONFIGMAP, help="bench results ConfigMap")
    a("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY, help="largest request body accepted")
    add_log_level(parser)


@dataclass(frozen=True, kw_only=True)
class Settings(ProcessSettings):
    """Everything `wakegate scheduler-extender` is configured with; built once from its command line."""

    listen_host: str
    """Address the extender serves on."""
    listen_port: int
    """Port the extender serves on."""
    kubeconfig: str | None
    """Where the cluster is (the seam's lookup order when None)."""
    bench_namespace: str
    """Namespace of the bench results ConfigMap."""
    bench_configmap: str
    """Name of the bench results ConfigMap."""
    max_body_bytes: int
    """Largest request body from kube-scheduler."""
    weights: Weights
    """Score weights, from the SCHED_*_WEIGHT environment variables."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        """Raises ValueError for a bad score weight."""
        host, port = args.listen
        return settings_from(cls, args, listen_host=host, listen_port=port, weights=Weights.from_env(os.environ))


async def _serve(app: web.Application, host: str, port: int) -> None:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    log.info("scheduler extender listening on http://%s:%d", host, port)
    stopped = asyncio.Event()
    graceful_exit(stopped, "scheduler-extender")
    await stopped.wait()
    log.info("scheduler extender stopping")
    await runner.cleanup()


def main(args: argparse.Namespace) -> int:
    return start(args, Settings.from_args, run, "scheduler-extender")


def run(settings: Settings) -> int:
    from kubernetes.config import ConfigException

    from wakegate.control.extender.kube import ClusterSources

    try:
        kube = Kube(api_client(settings.kubeconfig))
    except (ConfigException, OSError) as exc:
        log.error("no Kubernetes configuration: %s", exc)
        return 2
    sources = ClusterSources(kube, settings.bench_namespace, settings.bench_configmap)
    stop = threading.Event()
    sources.start(stop)
    bench = f"{settings.bench_namespace}/{settings.bench_configmap}"
    log.info("weights %s; bench results from %s", settings.weights, bench)
    app = make_app(sources, settings.weights, max_body=settings.max_body_bytes)
    try:
        asyncio.run(_serve(app, settings.listen_host, settings.listen_port))
    finally:
        stop.set()
    return 0
