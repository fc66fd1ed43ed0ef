"""`wakegate scaler`: demand aggregation, KEDA external-push scaler and the builtin scaling engine.

One process, three ports: the DemandService gateways report to (bearer token
from a mounted Secret), KEDA's ExternalScaler service (optional mTLS) and an
admin HTTP port (/metrics, /healthz). Models come from a read-only watch of
the cluster's Model objects, or from a manifest file (``--models-file``) to
run without a cluster. Models with ``spec.scaling.engine: builtin`` are scaled
here through their Deployment's scale subresource while this replica holds the
Lease. Demand is memory-only: after a restart, gateway reports rebuild it
within one report interval (2 s).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path

import grpc
from aiohttp import web

from wakegate.control import admin
from wakegate.control.demand.book import DemandBook
from wakegate.control.demand.service import DemandService
from wakegate.control.keda.hub import Hub
from wakegate.control.keda.service import TlsFiles, serve_external_scaler
from wakegate.control.scaler.metrics import ScalerMetrics
from wakegate.control.scaling.core import Core
from wakegate.control.schema import ManifestError, Model, parse_models
from wakegate.process import graceful_exit
from wakegate.v1 import demand_pb2_grpc

log = logging.getLogger("wakegate.scaler")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--demand-listen", default="0.0.0.0:9090", help="DemandService address for gateways")
    parser.add_argument("--demand-token-file", type=Path, default=None, help="bearer token gateways must present")
    parser.add_argument("--keda-listen", default="0.0.0.0:9091", help="ExternalScaler address for KEDA")
    parser.add_argument("--tls-cert", type=Path, default=None, help="server certificate (PEM) for the KEDA port")
    parser.add_argument("--tls-key", type=Path, default=None, help="server key (PEM) for the KEDA port")
    parser.add_argument(
        "--tls-client-ca", type=Path, default=None, help="CA for KEDA's client certificate: requires mTLS"
    )
    parser.add_argument("--admin-listen", default="0.0.0.0:8080", help="HTTP address for /metrics and /healthz")
    parser.add_argument("--models-file", type=Path, default=None, help="serve these Models instead of the cluster's")
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig (default: $KUBECONFIG, then in-cluster)")
    parser.add_argument("--namespace", default=None, help="watch Models in this namespace only (default: all)")
    parser.add_argument("--lease-name", default="wakegate-scaler", help="Lease that elects the builtin engine")
    parser.add_argument(
        "--lease-namespace", default=os.environ.get("POD_NAMESPACE", "default"), help="namespace of the Lease"
    )
    parser.add_argument("--identity", default=None, help="Lease holder identity (default: hostname + pid)")
    parser.add_argument("--log-level", default="INFO")



def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if (args.tls_cert is None) != (args.tls_key is None) or (args.tls_client_ca and not args.tls_cert):
        print("wakegate scaler: --tls-cert and --tls-key go together; --tls-client-ca needs them", file=sys.stderr)
        return 2
    models: list[Model] | None = None
    if args.models_file is not None:
        try:
            models = parse_models(args.models_file.read_text(encoding="utf-8"), str(args.models_file))
        except (OSError, ManifestError) as exc:
            print(f"wakegate scaler: {exc}", file=sys.stderr)
            return 2
    try:
        for address in (args.demand_listen, args.keda_listen, args.admin_listen):
            admin.host_port(address, "0.0.0.0")
    except ValueError as exc:
        print(f"wakegate scaler: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(Scaler(args, models).run())


class Scaler:
    def __init__(self, args: argparse.Namespace, models: list[Model] | None) -> None:
        self.args = args
        self.static_models = models
        self.book = DemandBook()
        self.core = Core(self.book)
        self.hub = Hub(self.core, clock=time.monotonic)
        self.leader = False
        self.metrics = ScalerMetrics(self.book, self.core, lambda: self.hub.streams, lambda: self.leader)
        self.stop = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    async def _start_admin(self) -> web.AppRunner:
        async def healthz(_: web.Request) -> web.Response:
            return web.json_response({"status": "ok", "models": len(self.core.models), "members": self.book.members})

        async def metrics(_: web.Request) -> web.Response:
            return admin.metrics_response(self.metrics.registry)

        host, port = admin.host_port(self.args.admin_listen, "0.0.0.0")
        return await admin.serve({"/metrics": metrics, "/healthz": healthz}, host, port)

    async def _start_demand(self) -> grpc.aio.Server:
        service = DemandService(self.book, self.hub.poke, token_file=self.args.demand_token_file)
        limits = self.book.limits
        server = grpc.aio.server(
            maximum_concurrent_rpcs=limits.max_concurrent_reports,
            options=[("grpc.max_receive_message_length", 2 * limits.max_report_bytes)],
        )
        demand_pb2_grpc.add_DemandServiceServicer_to_server(service, server)
        if server.add_insecure_port(self.args.demand_listen) == 0:
            raise OSError(f"cannot listen on {self.args.demand_listen}")
        await server.start()
        return server

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        graceful_exit(self.stop, "scaler")
        threads_stop = threading.Event()
        threads: list[threading.Thread] = []
        servers: list[grpc.aio.Server] = []
        admin = None
        try:
            if self.static_models is not None:
                self.core.set_models(self.static_models, time.monotonic())
            else:
                threads = self._start_kube(loop, threads_stop)
            self.hub.evaluate()
            admin = await self._start_admin()
            servers.append(await self._start_demand())
            tls = (
                TlsFiles(self.args.tls_cert, self.args.tls_key, self.args.tls_client_ca) if self.args.tls_cert else None
            )
            keda, port = await serve_external_scaler(self.hub, self.args.keda_listen, tls)
            servers.append(keda)
            log.info(
                "wakegate scaler: demand=%s keda=%s (port %d, %s) admin=%s",
                self.args.demand_listen,
                self.args.keda_listen,
                port,
                "mTLS" if self.args.tls_client_ca else "TLS" if tls else "plaintext",
                self.args.admin_listen,
            )
            print("wakegate scaler: ready", flush=True)
            await self.stop.wait()
        finally:
            threads_stop.set()
            for server in servers:
                await server.stop(1)
            if admin is not None:
                await admin.cleanup()
            for thread in threads:
                await asyncio.to_thread(thread.join, 10)
        return 0

    def _start_kube(self, loop: asyncio.AbstractEventLoop, stop: threading.Event) -> list[threading.Thread]:
        from kubernetes import client, config

        from wakegate.control.scaler.kube import BuiltinEngine, ModelWatch
        from wakegate.control.scaler.lease import LeaseElector

        if self.args.kubeconfig or os.environ.get("KUBECONFIG"):
            api = config.new_client_from_config(config_file=self.args.kubeconfig)
        else:
            config.load_incluster_config()
            api = client.ApiClient()
        engine = BuiltinEngine(api, self.metrics, self.hub.poke)
        self.hub.add_listener(engine.apply)

        latest: list[list[Model]] = []
        serial = asyncio.Lock()

        async def take_models() -> None:
            async with serial:
                if not latest:
                    return
                models = latest.pop()
                latest.clear()
                current: dict[str, int] = {}
                for model in models:
                    if model.key not in self.core.models:
                        # Start from the Deployment's count: a restart neither wakes nor cuts a model.
                        with contextlib.suppress(Exception):
                            current[model.key] = await asyncio.to_thread(engine.current_replicas, model)
                self.core.set_models(models, time.monotonic(), current)
                engine.models = dict(self.core.models)
                self.hub.poke()

        def on_models(models: list[Model]) -> None:
            latest.append(models)
            self._tasks.add(task := loop.create_task(take_models()))
            task.add_done_callback(self._tasks.discard)

        def on_leader(leader: bool) -> None:
            def switch() -> None:
                self.leader = leader
                engine.set_leader(leader)

            loop.call_soon_threadsafe(switch)

        identity = self.args.identity or f"{socket.gethostname()}-{os.getpid()}"
        watcher = ModelWatch(api, self.args.namespace, loop, on_models)
        elector = LeaseElector(api, self.args.lease_namespace, self.args.lease_name, identity, on_leader)
        threads = [
            threading.Thread(target=watcher.run, args=(stop,), name="model-watch", daemon=True),
            threading.Thread(target=elector.run, args=(stop,), name="lease", daemon=True),
        ]
        for thread in threads:
            thread.start()
        # The watch thread blocks in a long request and is a daemon: only the elector is joined
        # on the way out, so that it releases the Lease.
        return threads[1:]
