"""`wakegate scaler`: demand aggregation, KEDA external-push scaler and the builtin scaling engine.

One process, three ports: the DemandService gateways report to (the internal
token, wakegate.internal_token), KEDA's ExternalScaler service (optional mTLS) and an
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
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from aiohttp import web

from wakegate import internal_token
from wakegate.control import admin
from wakegate.control.demand.book import DemandBook
from wakegate.control.demand.service import DemandService
from wakegate.control.feeder.h2guard import GuardedServer, serve_guarded
from wakegate.control.k8s.client import add_kubeconfig
from wakegate.control.keda.hub import Hub
from wakegate.control.keda.service import TlsFiles, serve_external_scaler
from wakegate.control.manifests import ManifestError, parse_models
from wakegate.control.scaler.metrics import ScalerMetrics
from wakegate.control.scaling.core import Core
from wakegate.control.schema import Model
from wakegate.internal_token import Authenticator, TokenSource
from wakegate.process import ProcessSettings, add_log_level, graceful_exit, host_port, settings_from, start
from wakegate.v1 import demand_pb2_grpc

log = logging.getLogger("wakegate.scaler")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--demand-listen", default="0.0.0.0:9090", help="DemandService address for gateways")
    internal_token.add_arguments(parser, server=True)
    parser.add_argument("--keda-listen", default="0.0.0.0:9091", help="ExternalScaler address for KEDA")
    parser.add_argument("--tls-cert", type=Path, default=None, help="server certificate (PEM) for the KEDA port")
    parser.add_argument("--tls-key", type=Path, default=None, help="server key (PEM) for the KEDA port")
    parser.add_argument(
        "--tls-client-ca", type=Path, default=None, help="CA for KEDA's client certificate: requires mTLS"
    )
    parser.add_argument("--admin-listen", default="0.0.0.0:8080", help="HTTP address for /metrics and /healthz")
    parser.add_argument("--models-file", type=Path, default=None, help="serve these Models instead of the cluster's")
    add_kubeconfig(parser)
    parser.add_argument("--namespace", default=None, help="watch Models in this namespace only (default: all)")
    parser.add_argument("--lease-name", default="wakegate-scaler", help="Lease that elects the builtin engine")
    parser.add_argument(
        "--lease-namespace", default=os.environ.get("POD_NAMESPACE", "default"), help="namespace of the Lease"
    )
    parser.add_argument("--identity", default=None, help="Lease holder identity (default: hostname + pid)")
    add_log_level(parser)


@dataclass(frozen=True, kw_only=True)
class Settings(ProcessSettings):
    """Everything `wakegate scaler` is configured with; built once from its command line."""

    demand_listen: str
    """DemandService address gateways report to."""
    internal_token: TokenSource | None
    """The internal token gateways must present; None: none asked (`--no-internal-auth`)."""
    keda_listen: str
    """ExternalScaler address for KEDA."""
    tls: TlsFiles | None
    """TLS of the KEDA port (mTLS with a client CA); None: plaintext."""
    admin_listen: str
    """HTTP address of /metrics and /healthz."""
    models: tuple[Model, ...] | None
    """Serve these Models instead of watching the cluster's."""
    kubeconfig: str | None
    """Where the cluster is (the seam's lookup order when None)."""
    namespace: str | None
    """Watch Models in this namespace only; None: all."""
    lease_namespace: str
    """Namespace of the Lease that elects the builtin engine."""
    lease_name: str
    """Name of that Lease."""
    identity: str
    """This replica's name in the Lease."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        """Raises ValueError with a message for the user."""
        if (args.tls_cert is None) != (args.tls_key is None) or (args.tls_client_ca and not args.tls_cert):
            raise ValueError("--tls-cert and --tls-key go together; --tls-client-ca needs them")
        models = None
        if args.models_file is not None:
            try:
                models = tuple(parse_models(args.models_file.read_text(encoding="utf-8"), str(args.models_file)))
            except (OSError, ManifestError) as exc:
                raise ValueError(str(exc)) from None
        for address in (args.demand_listen, args.keda_listen, args.admin_listen):
            host_port(address, "0.0.0.0")
        return settings_from(
            cls,
            args,
            tls=TlsFiles(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None,
            models=models,
            internal_token=internal_token.source_from(args, server=True),
            identity=args.identity or f"{socket.gethostname()}-{os.getpid()}",
        )


def main(args: argparse.Namespace) -> int:
    return start(args, Settings.from_args, lambda settings: asyncio.run(Scaler(settings).run()), "scaler")


class Scaler:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.book = DemandBook()
        self.core = Core(self.book)
        #: Backend pods per model from the pod watch (None until it listed once, and without a
        #: cluster): a GPU group's incoming member starts only once the outgoing one's are gone.
        self.pods: dict[str, int] | None = None
        self.hub = Hub(self.core, clock=time.monotonic, live=lambda: self.pods)
        self.leader = False
        token = settings.internal_token
        self.authenticator = Authenticator(token) if token else None
        self.metrics = ScalerMetrics(
            self.book, self.core, lambda: self.hub.streams, lambda: self.leader, self.authenticator
        )
        self.stop = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    async def _start_admin(self) -> web.AppRunner:
        async def healthz(_: web.Request) -> web.Response:
            return web.json_response({"status": "ok", "models": len(self.core.models), "members": self.book.members})

        async def metrics(_: web.Request) -> web.Response:
            return admin.metrics_response(self.metrics.registry)

        host, port = host_port(self.settings.admin_listen, "0.0.0.0")
        return await admin.serve({"/metrics": metrics, "/healthz": healthz}, host, port)

    async def _start_demand(self) -> GuardedServer:
        service = DemandService(self.book, self.hub.poke, authenticator=self.authenticator)
        limits = self.book.limits
        server = grpc.aio.server(
            maximum_concurrent_rpcs=limits.max_concurrent_reports,
            options=[("grpc.max_receive_message_length", 2 * limits.max_report_bytes)],
        )
        demand_pb2_grpc.add_DemandServiceServicer_to_server(service, server)
        # Gateways reach this port over the network: PING and SETTINGS floods are cut in front
        # of grpcio (docs/decisions.md, "The feeder's xDS port").
        guarded, _ = await serve_guarded(server, self.settings.demand_listen)
        return guarded

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        graceful_exit(self.stop, "scaler")
        threads_stop = threading.Event()
        threads: list[threading.Thread] = []
        servers: list[grpc.aio.Server | GuardedServer] = []
        admin = None
        try:
            if self.settings.models is not None:
                self.core.set_models(self.settings.models, time.monotonic())
            else:
                threads = self._start_kube(loop, threads_stop)
            self.hub.evaluate()
            admin = await self._start_admin()
            servers.append(await self._start_demand())
            tls = self.settings.tls
            keda, port = await serve_external_scaler(self.hub, self.settings.keda_listen, tls)
            servers.append(keda)
            log.info(
                "wakegate scaler: demand=%s (%s) keda=%s (port %d, %s) admin=%s",
                self.settings.demand_listen,
                "internal token" if self.settings.internal_token else "no auth",
                self.settings.keda_listen,
                port,
                "mTLS" if tls and tls.client_ca else "TLS" if tls else "plaintext",
                self.settings.admin_listen,
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
        from wakegate.control.k8s.client import Kube, api_client
        from wakegate.control.scaler.kube import BuiltinEngine, WaitingWriter, model_watch, pod_watch
        from wakegate.control.scaler.lease import LeaseElector

        kube = Kube(api_client(self.settings.kubeconfig))
        engine = BuiltinEngine(kube, self.metrics, self.hub.poke)
        waiting = WaitingWriter(kube, self.hub.poke)
        self.hub.add_listener(engine.apply)
        self.hub.add_listener(waiting.apply)

        # Only the newest Model set waits to be taken (a burst of changes is one set, not many).
        latest: list[list[Model]] = []
        serial = asyncio.Lock()

        async def take_models() -> None:
            async with serial:
                if not latest:
                    return
                models = latest.pop()
                current: dict[str, int] = {}
                for model in models:
                    if model.key not in self.core.models:
                        # Start from the Deployment's count: a restart neither wakes nor cuts a model.
                        with contextlib.suppress(Exception):
                            current[model.key] = await asyncio.to_thread(engine.current_replicas, model)
                self.core.set_models(models, time.monotonic(), current)
                gone = engine.models.keys() - self.core.models.keys()
                engine.models = dict(self.core.models)
                waiting.models = dict(self.core.models)
                engine.forget(gone)
                waiting.forget(gone)
                self.hub.poke()

        def on_models(models: list[Model]) -> None:
            pending = bool(latest)
            latest[:] = [models]
            if not pending:
                self._tasks.add(task := loop.create_task(take_models()))
                task.add_done_callback(self._tasks.discard)

        def on_pods(counts: dict[str, int]) -> None:
            if counts != self.pods:
                self.pods = counts
                self.hub.poke()

        def on_leader(leader: bool) -> None:
            def switch() -> None:
                self.leader = leader
                engine.set_leader(leader)
                waiting.set_leader(leader)

            loop.call_soon_threadsafe(switch)

        cfg = self.settings
        elector = LeaseElector(kube, cfg.lease_namespace, cfg.lease_name, cfg.identity, on_leader)
        threads = [
            model_watch(kube, cfg.namespace, loop, on_models, engine.model_event).start(stop),
            pod_watch(kube, cfg.namespace, loop, on_pods).start(stop),
            threading.Thread(target=elector.run, args=(stop,), name="lease", daemon=True),
        ]
        threads[-1].start()
        # The watch threads block in long requests and are daemons: only the elector is joined
        # on the way out, so that it releases the Lease.
        return threads[-1:]
