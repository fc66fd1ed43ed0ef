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

from aiohttp import web

from wakegate.control.admin import host_port
from wakegate.control.extender.server import DEFAULT_MAX_BODY, make_app
from wakegate.control.placement.benchdata import DEFAULT_CONFIGMAP
from wakegate.control.placement.rules import Weights
from wakegate.process import graceful_exit

log = logging.getLogger("wakegate.extender")


def _host_port(value: str) -> tuple[str, int]:
    try:
        return host_port(value, "0.0.0.0")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--listen", type=_host_port, default=("0.0.0.0", 8888), metavar="HOST:PORT",
      help="address to serve the extender on (default 0.0.0.0:8888)")
    a("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, else $KUBECONFIG)")
    a("--bench-namespace", default=os.environ.get("POD_NAMESPACE", "wakegate"),
      help="namespace of the bench results ConfigMap (default: $POD_NAMESPACE or wakegate)")
    a("--bench-configmap", default=DEFAULT_CONFIGMAP, help=f"bench results ConfigMap (default {DEFAULT_CONFIGMAP})")
    a("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY, help="largest request body accepted")
    a("--log-level", default="INFO", help="logging level (default INFO)")


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
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        weights = Weights.from_env(os.environ)
    except ValueError as exc:
        log.error("bad score weight: %s", exc)
        return 2
    from kubernetes.client import CoreV1Api
    from kubernetes.config import ConfigException

    from wakegate.control.extender.kube import ClusterSources, api_client

    try:
        api = api_client(args.kubeconfig)
    except (ConfigException, OSError) as exc:
        log.error("no Kubernetes configuration: %s", exc)
        return 2
    sources = ClusterSources(CoreV1Api(api), args.bench_namespace, args.bench_configmap)
    stop = threading.Event()
    sources.start(stop)
    log.info("weights %s; bench results from %s/%s", weights, args.bench_namespace, args.bench_configmap)
    host, port = args.listen
    try:
        asyncio.run(_serve(make_app(sources, weights, max_body=args.max_body_bytes), host, port))
    finally:
        stop.set()
    return 0
