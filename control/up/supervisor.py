"""The `wakegate up` supervisor: feeder, extproc, Envoy and the model replicas of one machine.

Starts, in order: the xDS feeder (in this process), extproc, Envoy, then the backend
replicas the scaler asks for. The first SIGINT/SIGTERM drains and stops every child (Envoy
first, so no new request is admitted); a second one exits at once. Children die with this
process even if it is SIGKILLed. `status()` (status.py) is what the admin port's /status serves;
its settings are settings.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import aiohttp
import grpc
from aiohttp import web

from wakegate import contract, internal_token
from wakegate.control import admin, bootstrap
from wakegate.control.admin import free_port
from wakegate.control.delivery.progress import human_bytes
from wakegate.control.delivery.registry import RegistrySettings
from wakegate.control.delivery.resolver import Access, Verify
from wakegate.control.demand.book import DemandBook
from wakegate.control.demand.service import DemandService
from wakegate.control.feeder.routed import RoutedModel
from wakegate.control.feeder.settings import GatewaySettings
from wakegate.control.keda.hub import Hub as ScalerHub
from wakegate.control.keda.service import serve_local
from wakegate.control.local import gateway as local_gateway
from wakegate.control.local.children import Child, CrashLoop, Supervised
from wakegate.control.savings.metrics import TierCollector
from wakegate.control.scaling.savings import Ledger
from wakegate.control.up.feeder import RoutedSource, gateway_json
from wakegate.control.up.gpus import discover
from wakegate.control.up.metrics import UpMetrics
from wakegate.control.up.native import NativeDemand
from wakegate.control.up.predictive import HISTORY_FILE, Predictive
from wakegate.control.up.replica import RuntimeSettings, Tier
from wakegate.control.up.runtime import ModelRuntime
from wakegate.control.up.scaler import LocalScaler
from wakegate.control.up.settings import Settings
from wakegate.control.up.status import UpStatus
from wakegate.control.up.weights import Delivery, DeliveryConfig
from wakegate.envoycounters import POLL_SECONDS, STATS_QUERY, parse_counters, stat_name
from wakegate.internal_token import Authenticator, TokenSource
from wakegate.process import graceful_exit, host_port
from wakegate.v1 import demand_pb2_grpc

log = logging.getLogger("wakegate.up")


@dataclass
class Ports:
    xds: int
    demand: int
    extproc: tuple[int, int]
    extproc_admin: tuple[int, int]
    activator: tuple[int, int]


#: Seconds in-flight requests and streams get to finish after the first SIGTERM/SIGINT.
DRAIN_SECONDS = 30.0


class _Refusals:
    """Refused internal calls of this process (demand) and of its feeder (ADS), summed."""

    def __init__(self, *parts: admin.RefusalCounts) -> None:
        self._parts = parts

    @property
    def refused(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for part in self._parts:
            for service, n in part.refused.items():
                total[service] = total.get(service, 0) + n
        return total


class Up(UpStatus):
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.models = list(settings.models)
        self.state_dir: Path = settings.state_dir
        self.gateway = GatewaySettings(
            listen_host=settings.listen_host,
            listen_port=settings.listen_port,
            max_request_bytes=settings.max_body_bytes,
            upstream_header=settings.upstream_header,
            access_log_clusters=(contract.access_log_cluster(0), contract.access_log_cluster(1)),
            # The feeder gives the native routes the key file's keys (it reads the file itself).
            native_allowed=True,
            key_checks=settings.api_keys_file is not None,
            global_rate_limit=settings.global_rps > 0,
            # The gateway-wide bucket in Envoy: one for both extprocs, whichever gets a request.
            global_rps=settings.global_rps,
            global_burst=settings.global_burst,
            replay=True,
        )
        self.source = RoutedSource(self.state_dir / "run" / "feeder.sock", self._routed, self._routed_one)
        self.envoy_admin = self.state_dir / "run" / "envoy-admin.sock"
        self.runtime_settings = RuntimeSettings(
            log_dir=self.state_dir / "logs",
            engines_dir=self.state_dir / "engines",
            base_dir=settings.file.resolve().parent,
        )
        self.gpus = discover(settings.fake_gpus)
        # One cache and one registry access for every model: two Models naming one digest share
        # one entry, and one pull.
        self.delivery = Delivery(
            DeliveryConfig(
                cache_dir=settings.cache_dir,
                max_size=settings.cache_max_size,
                verify=Verify(settings.cache_verify),
                flash_dir=settings.flash_dir,
            ),
            Access.from_env(
                RegistrySettings(
                    docker_config=settings.registry_config, ca_file=settings.ca_file, plain_http=settings.plain_http
                )
            ),
        )
        self.runtimes = {
            m.key: ModelRuntime(
                m, self.runtime_settings, partial(self.source.publish_soon, m.key), self.gpus, self.delivery
            )
            for m in self.models
        }
        self.metrics = UpMetrics()
        self.book = DemandBook()
        self.scaler = LocalScaler(
            self.runtimes, self.book, on_cold_start=self._cold_start, on_swap=self._swap, on_tier=self._tier
        )
        #: What idling saved (accelerator-seconds per tier, wakes): /status, /savings, /metrics.
        self.ledger = Ledger()
        self.started_at = time.time()
        for runtime in self.runtimes.values():
            self._tier(runtime)
            runtime.on_woken = self._woken
        self.metrics.registry.register(TierCollector(self.ledger))
        # Demand history (every model's, kept across restarts) and predictive wakes.
        self.predictive = Predictive(
            self.runtimes,
            self.scaler.core,
            self.state_dir / HISTORY_FILE,
            warm_seconds=self._warm_seconds,
        )
        self.predictive.on_outcome = self._predicted
        self.predictive.on_first_request = lambda key, warm: self.metrics.first_requests.labels(
            key, "warm" if warm else "cold"
        ).inc()
        self.scaler.predictive = self.predictive
        # The internal channels (ADS, demand) are authenticated on loopback too: another local
        # user must not be able to subscribe to the routes or report fake demand.
        self.token = TokenSource(internal_token.generate((self.state_dir / "secrets" / "internal-token").resolve()))
        self.authenticator = Authenticator(self.token)
        self.metrics.registry.register(admin.RefusedCalls(_Refusals(self.authenticator, self.source)))
        #: This gateway's xDS node id, Envoy's and extproc's (`--gateway-id`): the feeder gates
        #: each gateway's endpoints by the acknowledgements of its own Envoy and extproc.
        self.node_id = f"wakegate-up-{os.getpid()}"
        self.demand_service = DemandService(self.book, self._demand_changed, authenticator=self.authenticator)
        self.scaler_hub: ScalerHub | None = None
        for runtime in self.runtimes.values():
            runtime.in_flight = self._in_flight_of(runtime.model.key)
            runtime.on_activation_failed = lambda rt, _reason: self.metrics.activation_failures.labels(
                rt.model.key
            ).inc()
            runtime.on_attempt_failed = lambda rt, _reason: self.metrics.start_attempt_failures.labels(
                rt.model.key
            ).inc()
            self._watch_weights(runtime)
            self._watch_adapters(runtime)
        #: The runtimes' adapter hot swaps (a demand report pokes these, not every model).
        self._hotswaps = [rt.hotswap for rt in self.runtimes.values() if rt.hotswap is not None]
        self.components: dict[str, Supervised] = {}
        self.ports: Ports | None = None
        self.drain_seconds = DRAIN_SECONDS
        self._stop = asyncio.Event()
        self._failure: str | None = None
        self.serving = False

    def _watch_weights(self, runtime: ModelRuntime) -> None:
        key = runtime.model.key

        def pulled(size: int, seconds: float) -> None:
            self.metrics.weights_pulled_bytes.labels(key).inc(size)
            self.metrics.weights_pull_seconds.labels(key).observe(seconds)
            log.info("weights pulled model=%s bytes=%d (%s) seconds=%.2f", key, size, human_bytes(size), seconds)

        runtime.weights_watch.on_pulled = pulled
        runtime.weights_watch.on_corrupt = lambda _problem: self.metrics.weights_corrupt.labels(key).inc()

    def _watch_adapters(self, runtime: ModelRuntime) -> None:
        """On-demand adapters: what the gateways want of them, and their metrics."""
        hotswap = runtime.hotswap
        if hotswap is None:
            return
        key = runtime.model.key
        runtime.adapter_demand = lambda: self.book.adapter_totals(key)
        metrics = self.metrics

        def loaded(adapter: str, seconds: float) -> None:
            metrics.adapter_loads.labels(key, adapter).inc()
            metrics.adapter_load_seconds.labels(key).observe(seconds)

        hotswap.events.loaded = loaded
        hotswap.events.unloaded = lambda adapter, reason: metrics.adapter_unloads.labels(key, adapter, reason).inc()
        hotswap.events.failed = lambda adapter: metrics.adapter_load_failures.labels(key, adapter).inc()

    def _in_flight_of(self, key: str) -> Callable[[], int]:
        def in_flight() -> int:
            load = self.scaler.loads.get(key)
            return load.in_flight if load is not None else 0

        return in_flight

    def _demand_changed(self) -> None:
        self.scaler.poke()
        for hotswap in self._hotswaps:
            hotswap.poke()
        if self.scaler_hub is not None:
            self.scaler_hub.poke()

    # -- observability --------------------------------------------------------------------------

    def _tier(self, runtime: ModelRuntime) -> None:
        self.ledger.observe(runtime.model.key, runtime.tier.value, runtime.tier_units, time.time())

    def _warm_seconds(self, model: str, since: float, until: float) -> float:
        window = self.ledger.window_of(model, since, until)
        return 0.0 if window is None else float(window["accelerator_seconds"]["warm"])

    def _predicted(self, model: str, outcome: str, spent: float) -> None:
        self.metrics.predictive_wakes.labels(model, outcome).inc()
        self.metrics.predictive_seconds.labels(model, outcome).inc(spent)

    def _woken(self, runtime: ModelRuntime, seconds: float) -> None:
        if not self.predictive.speculating(runtime.model.key):
            self._wake(runtime.model.key, Tier.ASLEEP.value, seconds)

    def _wake(self, model: str, tier: str, seconds: float) -> None:
        self.ledger.wake(model, tier, seconds, time.time())
        self.metrics.wake_seconds.labels(model, tier).observe(seconds)
        log.info("wake model=%s tier=%s seconds=%.3f", model, tier, seconds)

    def _cold_start(self, model: str, stage: str, seconds: float) -> None:
        if stage == "total" and not self.predictive.speculating(model):
            # A predictive wake no request waited for costs no waiting (its seconds are its own).
            self._wake(model, Tier.ZERO.value, seconds)
        self.metrics.cold_start.labels(model, stage).observe(seconds)
        if stage == "process_start":
            self.metrics.cold_starts.labels(model).inc()
        log.info("cold start model=%s stage=%s seconds=%.3f", model, stage, seconds)

    def _swap(self, group: str, old: str | None, new: str) -> None:
        if old is not None and new:
            self.metrics.swaps.labels(group).inc()

    def _refresh_gauges(self) -> None:
        for key, runtime in self.runtimes.items():
            load = self.scaler.loads.get(key)
            self.metrics.replicas.labels(key).set(runtime.replica_count)
            self.metrics.ready.labels(key).set(len(runtime.ready_endpoints))
            self.metrics.queued.labels(key).set(load.queued if load else 0)
            self.metrics.in_flight.labels(key).set(load.in_flight if load else 0)
            self.metrics.leases.labels(key).set(load.leases if load else 0)

    # -- feeder -------------------------------------------------------------------------------

    def _routed(self) -> list[RoutedModel]:
        return [runtime.routed() for runtime in self.runtimes.values()]

    def _routed_one(self, key: str) -> RoutedModel | None:
        runtime = self.runtimes.get(key)
        return None if runtime is None else runtime.routed()

    # -- lifecycle ----------------------------------------------------------------------------

    async def run(self) -> int:
        graceful_exit(self._stop, "wakegate up")
        demand_server = None
        keda_server = None
        admin = None
        watchers: list[asyncio.Task[None]] = []
        try:
            problem = _cannot_bind(self.gateway.listen_host, self.gateway.listen_port)
            if problem:
                log.error(
                    "wakegate up: cannot listen on %s:%d: %s",
                    self.gateway.listen_host,
                    self.gateway.listen_port,
                    problem,
                )
                return 2
            admin = await self._start_admin()
            if self.settings.scaler_listen:
                keda_server, self.scaler_hub, _ = await serve_local(self.book, self.models, self.settings.scaler_listen)
            demand_server, demand_port = await self._start_demand()
            await self.source.start()
            ports = Ports(
                xds=free_port(),
                demand=demand_port,
                extproc=(free_port(), free_port()),
                extproc_admin=(free_port(), free_port()),
                activator=(free_port(), free_port()),
            )
            self.ports = ports
            self._add(self._feeder(ports))
            self._add(self._extproc(ports, 0))
            self._add(self._extproc(ports, 1))
            self._add(self._envoy(ports))
            for component in self.components.values():
                await component.start()
            watchers = [asyncio.create_task(self._watch(c)) for c in self.components.values()]
            watchers.append(asyncio.create_task(self.scaler.run()))
            watchers += [asyncio.create_task(rt.hotswap.run()) for rt in self.runtimes.values() if rt.hotswap]
            watchers.append(asyncio.create_task(self._native_demand()))
            if self.predictive.speculation:
                watchers.append(asyncio.create_task(self._requests_routed()))
            self.scaler.poke()
            if self.settings.status_display:
                watchers.append(asyncio.create_task(self._status_display()))
            if await self._wait_gateway_ready(ports):
                names = ", ".join(m.key for m in self.models)
                self.serving = True
                log.info(
                    "wakegate up: gateway http://%s:%d models=[%s] envoy_admin=%s",
                    self.gateway.listen_host,
                    self.gateway.listen_port,
                    names,
                    self.settings.envoy_admin_listen or f"unix:{self.envoy_admin} (owner-only)",
                )
                print(
                    f"wakegate up: serving on http://{self.gateway.listen_host}:{self.gateway.listen_port}",
                    flush=True,
                )
            await self._stop.wait()
            if self._failure is None:
                await self._drain()
            for watcher in watchers:
                watcher.cancel()
        finally:
            await self._shutdown()
            if demand_server is not None:
                await demand_server.stop(1)
            if keda_server is not None:
                await keda_server.stop(1)
            if admin is not None:
                await admin.cleanup()
            await self.source.close()
        if self._failure:
            log.error("%s", self._failure)
            print(f"wakegate up: stopped: {self._failure.splitlines()[0]}", file=sys.stderr, flush=True)
            return 1
        return 0

    async def _start_admin(self) -> web.AppRunner:
        async def status(_: web.Request) -> web.Response:
            return web.json_response(self.status())

        async def savings(request: web.Request) -> web.Response:
            now = time.time()
            try:
                until = float(request.query.get("until", now))
                since = float(request.query.get("since", self.started_at))
            except ValueError:
                return web.json_response({"error": "since and until are epoch seconds"}, status=400)
            if since > until:
                return web.json_response({"error": "since is after until"}, status=400)
            return web.json_response(self.savings(since, until))

        async def healthz(_: web.Request) -> web.Response:
            return web.json_response({"status": "ok"})

        async def metrics(_: web.Request) -> web.Response:
            self._refresh_gauges()
            return admin.metrics_response(self.metrics.registry)

        async def gateway_metrics(_: web.Request) -> web.Response:
            return await self._gateway_metrics()

        host, port = host_port(self.settings.admin_listen)
        routes = {"/metrics": metrics, "/metrics/gateway": gateway_metrics, "/status": status, "/healthz": healthz,
                  "/savings": savings}
        return await admin.serve(routes, host, port)

    async def _gateway_metrics(self) -> web.Response:
        """The serving extproc's /metrics (the primary, else the standby), as the gateway port served them.

        The gateway's own listener keeps /metrics off by default (`--public-metrics`): this is the
        stable address to scrape them from (extproc's admin ports are picked at start).
        """
        ports = self.ports
        if ports is not None:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
                for port in ports.extproc_admin:
                    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                        async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                            if resp.status == 200:
                                body = await resp.read()
                                return web.Response(body=body, headers={"Content-Type": resp.headers["Content-Type"]})
        return web.json_response({"error": "no extproc answers yet"}, status=503)

    async def _start_demand(self) -> tuple[grpc.aio.Server, int]:
        """The demand receiver extproc reports to: here, beside the scaler that reads it."""
        server = grpc.aio.server()
        demand_pb2_grpc.add_DemandServiceServicer_to_server(self.demand_service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    def _add(self, component: Supervised) -> None:
        self.components[component.child.name] = component

    def _feeder(self, ports: Ports) -> Supervised:
        argv = [
            sys.executable,
            "-m",
            "wakegate.control.up.feeder",
            "--listen",
            f"127.0.0.1:{ports.xds}",
            "--source",
            str(self.source.path),
            "--gateway",
            gateway_json(self.gateway),
            "--internal-token-file",
            str(self.token.file),
            "--log-level",
            self.settings.log_level,
        ]
        if self.settings.api_keys_file is not None:
            argv += ["--api-keys-file", str(self.settings.api_keys_file.resolve())]
        return Supervised(Child("feeder", argv, self.state_dir / "logs" / "feeder.log"))

    def _extproc(self, ports: Ports, index: int) -> Supervised:
        argv = [
            sys.executable,
            "-m",
            "wakegate.extproc",
            "--listen",
            f"127.0.0.1:{ports.extproc[index]}",
            "--admin-listen",
            f"127.0.0.1:{ports.extproc_admin[index]}",
            "--activator-listen",
            f"127.0.0.1:{ports.activator[index]}",
            "--keepalive-seconds",
            str(self.settings.keepalive_seconds),
            "--xds",
            f"127.0.0.1:{ports.xds}",
            "--demand",
            f"127.0.0.1:{ports.demand}",
            "--node-id",
            f"wakegate-up-{os.getpid()}-extproc-{index}",
            "--internal-token-file",
            str(self.token.file),
            "--gateway-id",
            self.node_id,
            "--max-body-bytes",
            str(self.settings.max_body_bytes),
            "--global-rps",
            str(self.settings.global_rps),
            "--global-burst",
            str(self.settings.global_burst),
            "--drain-seconds",
            "1",
            "--log-level",
            self.settings.log_level,
        ]
        for limit in self.settings.extproc_h2_limit:
            argv += ["--h2-limit", limit]
        if self.settings.api_keys_file is not None:
            argv += ["--api-keys-file", str(self.settings.api_keys_file.resolve())]
        argv += ["--public-metrics", self.settings.public_metrics]
        if self.settings.fairness_header:
            argv.append("--fairness-header")
        return Supervised(Child(f"extproc-{index}", argv, self.state_dir / "logs" / f"extproc-{index}.log"))

    def _envoy(self, ports: Ports) -> Supervised:
        return local_gateway.envoy(
            self.state_dir,
            self.node_id,
            bootstrap.GatewayPorts(
                envoy_admin=self._envoy_admin_port(),
                xds=ports.xds,
                extproc=ports.extproc[0],
                extproc_standby=ports.extproc[1],
                activator=ports.activator[0],
                activator_standby=ports.activator[1],
                admin_socket=None if self.settings.envoy_admin_listen else str(self.envoy_admin),
            ),
            self.token.file,
            self.envoy_admin,
            concurrency=self.settings.envoy_concurrency,
            extproc_streams=_extproc_streams(self.settings.extproc_h2_limit),
        )

    async def _watch(self, component: Supervised) -> None:
        try:
            await component.run()
        except CrashLoop as exc:
            self._failure = str(exc)
            self._stop.set()

    def _envoy_admin_port(self) -> int:
        if self.settings.envoy_admin_listen is None:
            return 0
        return host_port(self.settings.envoy_admin_listen)[1]

    def _admin_session(self) -> aiohttp.ClientSession:
        """A client of Envoy's admin API (paths relative to it)."""
        return local_gateway.admin_session(self.settings.envoy_admin_listen, self.envoy_admin)

    async def _native_demand(self) -> None:
        """Envoy's counters of the natively routed models into the demand book, every POLL_SECONDS
        while any model takes the native path (docs/architecture.md, "The native path")."""
        native = NativeDemand(f"{self.node_id}/envoy-native")
        stat_names = {stat_name(key): key for key in self.runtimes}
        async with self._admin_session() as session:
            while True:
                await asyncio.sleep(POLL_SECONDS)
                keys = [key for key, rt in self.runtimes.items() if self._routing_path(rt)["routingPath"] == "native"]
                # A model that just left the native path still has native requests finishing on
                # its draining replica: it stays counted until they are done.
                keys += [key for key, count in native.reported.items() if count and key not in keys]
                if not keys and not native.reported:
                    continue
                counters: dict[str, tuple[int, int]] = {}
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError, ValueError):
                    async with session.get(STATS_QUERY) as response:
                        counters = parse_counters((await response.json()).get("stats", []), stat_names)
                if not counters and keys:
                    continue  # Envoy not answering: keep the last report (the book expires it if this lasts)
                before = dict(native.reported)
                in_flight = {key: load.in_flight for key, load in self.scaler.loads.items()}
                self.book.apply(native.report(counters, keys, in_flight), time.monotonic())
                if native.reported != before:
                    self._demand_changed()

    async def _requests_routed(self) -> None:
        """While a model uses predictive wake: Envoy's per-model request totals, every POLL_SECONDS,
        so that first requests too short for the demand reports are seen (and counted warm)."""
        stat_names = {stat_name(key): key for key in self.runtimes}
        totals: dict[str, int] | None = None  # None until a first look sets the baseline
        async with self._admin_session() as session:
            while True:
                await asyncio.sleep(POLL_SECONDS)
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError, ValueError):
                    async with session.get(STATS_QUERY) as response:
                        counters = parse_counters((await response.json()).get("stats", []), stat_names)
                    now = time.monotonic()
                    seen = {key: total for key, (_, total) in counters.items()}
                    if totals is not None:
                        # Envoy lists a model's counters from its first request on (usedonly).
                        for key in (k for k, total in seen.items() if total > totals.get(k, 0)):
                            if self.predictive.requests_seen(key, now):
                                self.scaler.poke()  # its outcome and the history's save are evaluated
                    totals = seen

    async def _wait_gateway_ready(self, ports: Ports) -> bool:
        """Whether the gateway serves (`local_gateway.wait_ready`); one that cannot stops `up` with the reason."""
        try:
            async with self._admin_session() as envoy_admin:
                return await local_gateway.wait_ready(
                    (self.gateway.listen_host, self.gateway.listen_port),
                    ports.extproc_admin,
                    envoy_admin,
                    self._stop,
                    self.state_dir / "logs" / "envoy.log",
                )
        except local_gateway.GatewayNotReady as exc:
            self._failure = str(exc)
            self._stop.set()
            return False

    async def _drain(self) -> None:
        """SIGTERM: Envoy stops accepting, in-flight requests and streams get up to the drain
        time to finish (held cold requests too: the models keep loading), then whatever is
        still held gets a retriable 503 from Envoy as extproc stops, then everything stops."""
        envoy = self.components.get("envoy")
        if envoy is None or not envoy.child.running:
            return
        log.info("wakegate up: draining (up to %.0fs): listener closed, in-flight requests finish", self.drain_seconds)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_seconds
        async with self._admin_session() as session:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                async with session.post("/drain_listeners") as response:
                    await response.read()
            while loop.time() < deadline:
                active = await local_gateway.envoy_stat(session, "http.wakegate.downstream_rq_active")
                if active is None or active == 0:
                    break
                await asyncio.sleep(0.1)
            else:
                log.warning("wakegate up: drain time over with requests still running")
        log.info("wakegate up: drained in %.2fs", self.drain_seconds - (deadline - loop.time()))

    async def _shutdown(self) -> None:
        log.info("wakegate up: stopping")
        order = ["extproc-0", "extproc-1", "envoy", "feeder"]  # held requests answered before Envoy goes
        for name in order:
            component = self.components.get(name)
            if component is not None:
                await component.stop(5.0)
        await asyncio.gather(*(rt.stop() for rt in self.runtimes.values()))
        self.predictive.flush()
        log.info("wakegate up: stopped")


def _cannot_bind(host: str, port: int) -> str | None:
    """Why the gateway's listener could not be bound now, or None."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def _extproc_streams(limits: tuple[str, ...]) -> int | None:
    """extproc's max_concurrent_streams when `--extproc-h2-limit` sets it (the last one wins)."""
    streams = None
    for item in limits:
        name, _, value = item.partition("=")
        if name.strip().replace("-", "_") == "max_concurrent_streams":
            streams = int(float(value))
    return streams
