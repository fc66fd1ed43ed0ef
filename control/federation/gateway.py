"""The global gateway: an Envoy and an extproc fed by their own xDS, member gateways as upstreams.

Nothing here forks the request path. The feeder library (`Publisher`, `SnapshotCache`, the ADS
server) runs in this process over a source that is the members' newest probes
(`members.global_routes`): per FederatedModel one `RoutedModel` whose endpoints are the member
gateways that are reachable and report the model ready, with their held + in-flight requests
as the endpoint's load. A stock `wakegate extproc` picks among them (least-loaded) and holds
requests for a model no member has warm, with its bounded queue; a stock Envoy carries them.

Pull, not push: one prober task per member asks `GET /wakegate/status` every health interval.
A failed probe (past the threshold) takes the member out of every route at once, so new
requests go elsewhere within one interval; requests Envoy could not connect for are retried on
another member (never once a member answered). A model cold everywhere reaches us as demand
from our own extproc (the DemandService on the ADS port, as in `wakegate up`): exactly one
member is asked to wake it (`members.wake_target`), the next one only if that wake fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from wakegate import contract, internal_token
from wakegate.control import admin, bootstrap
from wakegate.control.admin import free_port
from wakegate.control.demand.book import DemandBook
from wakegate.control.demand.service import DemandService
from wakegate.control.federation import members as fed
from wakegate.control.federation.members import Member, MemberHealth
from wakegate.control.federation.probe import (
    ProbeFailed,
    Tls,
    TlsFiles,
    TlsMaterial,
    probe,
    read_token,
    wake,
)
from wakegate.control.federation_schema import FederatedModel, Federation, RetryWhen
from wakegate.control.feeder.ads import start_server
from wakegate.control.feeder.cache import SnapshotCache
from wakegate.control.feeder.publisher import Publisher
from wakegate.control.feeder.routed import RoutedModel, UpstreamTls
from wakegate.control.feeder.settings import GatewaySettings
from wakegate.control.local import gateway as local_gateway
from wakegate.control.local.children import Child, CrashLoop, Supervised
from wakegate.internal_token import Authenticator, TokenSource
from wakegate.v1 import demand_pb2_grpc

log = logging.getLogger("wakegate.federation")

#: Envoy's retry_on per GlobalProxy `retries.when`: both end once a byte of the answer went out.
_RETRY_ON = {
    RetryWhen.UNSENT: "connect-failure,refused-stream,reset-before-request",
    RetryWhen.BEFORE_RESPONSE: "connect-failure,refused-stream,reset",
}


def _members_of(federation: Federation) -> dict[str, Member]:
    """The Clusters the global Envoy can route to (a gateway URL by IP); the others skipped, logged."""
    members: dict[str, Member] = {}
    for cluster in federation.clusters:
        try:
            members[cluster.name] = fed.member_of(cluster)
        except ValueError as exc:
            log.warning("federation: skipping %s", exc)
    return members


@dataclass(frozen=True)
class GatewayConfig:
    """What one global gateway runs with (built by `wakegate federation gateway`)."""

    federation: Federation
    #: Member token files by cluster name (resolved against the federation file's folder).
    token_files: Mapping[str, Path]
    state_dir: Path
    api_keys_file: Path | None = None
    admin_listen: tuple[str, int] | None = None
    upstream_header: bool = False
    log_level: str = "INFO"
    #: Member TLS files by cluster name (caFile, clientCertFile, clientKeyFile), resolved likewise.
    tls_files: Mapping[str, TlsFiles] = field(default_factory=dict)


def _write_private(folder: Path, kind: str, text: str) -> str:
    """`text` in `folder` as `<kind>-<digest>.pem`, readable by this user only (written once;
    the kind's older files removed); the file's path."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = folder / f"{kind}-{digest}.pem"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        partial = folder / f".{path.name}.partial"
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        partial.replace(path)
        for old in folder.glob(f"{kind}-*.pem"):
            if old != path:
                old.unlink(missing_ok=True)
    return str(path)


@dataclass
class _Wake:
    member: str
    started: float
    task: asyncio.Task[None]


@dataclass
class Counters:
    """What the global gateway did, for /status (and the figures in docs/federation.md)."""

    probes: int = 0
    probe_failures: int = 0
    #: A member left the routes of a model it served (it went down or stopped serving it).
    failovers: int = 0
    #: Wake requests sent, by model key.
    wakes: dict[str, int] = field(default_factory=dict)
    wake_failures: int = 0


class GlobalGateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        proxy = config.federation.proxy.spec
        self.check = proxy.healthCheck
        self.models: list[FederatedModel] = list(config.federation.models)
        self.members: dict[str, Member] = _members_of(config.federation)
        self.health: dict[str, MemberHealth] = {name: MemberHealth() for name in self.members}
        #: Wall-clock time of each member's last good probe (status shows it).
        self.seen_at: dict[str, float] = {}
        self.retries = proxy.retries.attempts
        listener = proxy.listeners[0]
        self.gateway = GatewaySettings(
            listen_host=listener.address,
            listen_port=listener.port,
            upstream_header=config.upstream_header,
            upstream_retries=proxy.retries.attempts,
            upstream_retry_on=_RETRY_ON[proxy.retries.when],
            access_log_clusters=(contract.access_log_cluster(0), contract.access_log_cluster(1)),
            replay=True,
        )
        self._routes: list[RoutedModel] = fed.global_routes(
            self.models, self.members.values(), self.health, self.retries
        )
        self.publisher = Publisher(SnapshotCache(), self.gateway, lambda: self._routes)
        self.state_dir = config.state_dir
        self.token = TokenSource(internal_token.generate((self.state_dir / "secrets" / "internal-token").resolve()))
        self.authenticator = Authenticator(self.token)
        self.book = DemandBook()
        self.demand = DemandService(self.book, self._demand_changed, authenticator=self.authenticator)
        self.counters = Counters()
        self._wakes: dict[str, _Wake] = {}
        #: Members whose wake failed during the current activation of a model.
        self._tried: dict[str, set[str]] = {}
        self._kicks: dict[str, asyncio.Event] = {name: asyncio.Event() for name in self.members}
        self._children: list[Supervised] = []
        self._watchers: list[asyncio.Task[None]] = []
        #: A child kept crashing past its restart budget: the gateway stops with status 1.
        self.failed = False
        self._probers: dict[str, asyncio.Task[None]] = {}
        #: Member tokens read from the federation cluster's Secrets (`follow`), by cluster.
        self.member_tokens: dict[str, str] = {}
        #: Member TLS material read from the federation cluster's Secrets (`follow`), by cluster.
        self.member_tls: dict[str, TlsMaterial] = {}
        self._session: aiohttp.ClientSession | None = None
        self.stop = asyncio.Event()
        self.node_id = f"wakegate-global-{os.getpid()}"

    # -- routes ------------------------------------------------------------------------------

    def _recompute(self) -> None:
        routes = fed.global_routes(
            self.models, self.members.values(), self.health, self.retries, self._tokens(), self._upstream_tls()
        )
        before = {r.key: set(r.endpoints) for r in self._routes}
        changed = False
        for route in routes:
            left = before.get(route.key, set()) - set(route.endpoints)
            self.counters.failovers += len(left)
            if set(route.endpoints) != before.get(route.key, set()):
                changed = True
                log.info("route model=%s members=%s", route.key, self._names(route.endpoints))
                if route.endpoints:
                    self._tried.pop(route.key, None)  # warm somewhere: the activation is over
        # Anything else too: loads, a member's token, a FederatedModel added or removed (`update`).
        republish = routes != self._routes
        self._routes = routes
        if republish:
            self.publisher.publish_soon()
        if changed:
            self._demand_changed()

    def _tokens(self) -> dict[str, str]:
        """Each member's token (the cluster's Secret, or its file read now), for Envoy to present."""
        tokens = dict(self.member_tokens)
        for name, path in self.config.token_files.items():
            with contextlib.suppress(ProbeFailed):
                token = read_token(path)
                if token:
                    tokens[name] = token
        return tokens

    def _material(self, name: str) -> TlsMaterial | None:
        """A member's TLS material now: from its Secrets, or its files read now (ProbeFailed)."""
        if name in self.member_tls:
            return self.member_tls[name]
        files = self.config.tls_files.get(name)
        return files.read() if files is not None else None

    def _client_tls(self, name: str) -> Tls | None:
        """How the prober and the waker verify an https:// member; ProbeFailed when they cannot."""
        member = self.members[name]
        if not member.tls:
            return None
        material = self._material(name)
        if material is None:
            raise ProbeFailed("tls: no CA for the https:// gateway (its ca or clientCert Secret could not be read)")
        return Tls.of(material, member.server_name)

    def _upstream_tls(self) -> dict[str, UpstreamTls]:
        """Each https:// member's TLS for the global Envoy: its material written (0600, named by
        content, so a rotation is a new file Envoy is pointed at) under the state dir's secrets.
        A member whose material cannot be read is left out (and so out of the routes)."""
        out: dict[str, UpstreamTls] = {}
        for name, member in self.members.items():
            if not member.tls:
                continue
            try:
                material = self._material(name)
            except ProbeFailed:
                continue  # its probe fails for the same reason, and says so
            if material is None:
                continue
            folder = self.state_dir / "secrets" / "members" / name
            files = {
                kind: _write_private(folder, kind, text)
                for kind, text in (("ca", material.ca), ("cert", material.cert), ("key", material.key))
                if text is not None
            }
            out[name] = UpstreamTls(
                name=name,
                ca_file=files["ca"],
                server_name=member.server_name,
                ip_san=None if member.server_name else member.host,
                cert_file=files.get("cert") if "key" in files else None,
                key_file=files.get("key") if "cert" in files else None,
            )
        return out

    def _names(self, endpoints: tuple[tuple[str, int], ...]) -> list[str]:
        by_endpoint = {m.endpoint: name for name, m in self.members.items()}
        return [by_endpoint.get(e, f"{e[0]}:{e[1]}") for e in endpoints]

    def update(
        self, federation: Federation, tokens: Mapping[str, str], tls: Mapping[str, TlsMaterial] | None = None
    ) -> None:
        """New Clusters and FederatedModels (from the federation cluster): members that left stop
        being probed and leave the routes, new ones are probed at once. The listener, retries and
        health check stay as they were at start."""
        members = _members_of(federation)
        for name in self.members.keys() - members.keys():
            task = self._probers.pop(name, None)
            if task is not None:
                task.cancel()
            self.health.pop(name, None)
            self._kicks.pop(name, None)
        for name, member in members.items():
            if self.members.get(name) != member:
                self.health[name] = MemberHealth()  # a new address: nothing known of it yet
            self._kicks.setdefault(name, asyncio.Event())
        self.members = members
        self.models = list(federation.models)
        self.member_tokens = dict(tokens)
        self.member_tls = dict(tls or {})
        if self._session is not None:
            for name in members.keys() - self._probers.keys():
                self._probers[name] = asyncio.ensure_future(self._probe_loop(name))
        self._recompute()

    # -- probing -------------------------------------------------------------------------------

    async def _probe_loop(self, name: str) -> None:
        kick = self._kicks[name]
        while not self.stop.is_set() and name in self.members:
            await self._probe_once(name)
            kick.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(kick.wait(), self.check.intervalSeconds)

    async def _probe_once(self, name: str) -> None:
        member = self.members[name]
        assert self._session is not None
        self.counters.probes += 1
        try:
            token = self.member_tokens.get(name) or read_token(self.config.token_files.get(name))
            tls = self._client_tls(name)
            report, latency = await probe(self._session, member.url, token, self.check.timeoutSeconds, tls)
        except ProbeFailed as exc:
            self.counters.probe_failures += 1
            state = self.health[name]
            if state.reachable or state.failures == 0:
                log.warning("member=%s probe failed: %s", name, exc)
            self.health[name] = state.failed(str(exc), self.check.unhealthyThreshold)
        else:
            if not self.health[name].reachable:
                log.info("member=%s reachable (%.1f ms)", name, latency * 1000)
            self.health[name] = self.health[name].observed(report, latency, time.monotonic())
            self.seen_at[name] = time.time()
        self._recompute()

    # -- waking ----------------------------------------------------------------------------------

    def _demand_changed(self) -> None:
        totals = self.book.totals()
        warm = {r.key for r in self._routes if r.endpoints}
        for model in self.models:
            key = fed.model_key(model)
            load = totals.get(key)
            if load is None or not (load.queued or load.leases) or key in warm or key in self._wakes:
                continue
            target = fed.wake_target(model, self.members.values(), self.health, self._tried.get(key, ()))
            if target is None:
                log.warning("model=%s cold everywhere and no reachable member serves it", key)
                continue
            self.counters.wakes[key] = self.counters.wakes.get(key, 0) + 1
            log.info("model=%s cold everywhere: asking member=%s to wake it", key, target.name)
            task = asyncio.ensure_future(self._wake(model, target))
            self._wakes[key] = _Wake(target.name, time.monotonic(), task)

    async def _wake(self, model: FederatedModel, target: Member) -> None:
        key = fed.model_key(model)
        assert self._session is not None
        try:
            timeout = float(model.spec.template.scaling.activationTimeout)
            token = self.member_tokens.get(target.name) or read_token(self.config.token_files.get(target.name))
            tls = self._client_tls(target.name) if target.name in self.members else None
            await wake(self._session, target.url, token, model.name, timeout, tls)
        except ProbeFailed as exc:
            self.counters.wake_failures += 1
            log.warning("model=%s member=%s did not wake: %s", key, target.name, exc)
            self._tried.setdefault(key, set()).add(target.name)
        else:
            # Probe it now: the held requests go as soon as its answer says the model is ready,
            # and the wake stays ours until then (no second one for the same activation).
            if target.name in self.members:
                await self._probe_once(target.name)
        finally:
            self._wakes.pop(key, None)
        self._demand_changed()

    # -- processes -------------------------------------------------------------------------------

    def _extproc(self, index: int, port: int, admin_port: int, activator: int, xds_port: int) -> Supervised:
        argv = [
            sys.executable, "-m", "wakegate.extproc",
            "--listen", f"127.0.0.1:{port}",
            "--admin-listen", f"127.0.0.1:{admin_port}",
            "--activator-listen", f"127.0.0.1:{activator}",
            "--xds", f"127.0.0.1:{xds_port}",
            "--node-id", f"{self.node_id}-extproc-{index}",
            "--gateway-id", self.node_id,
            "--internal-token-file", str(self.token.file),
            "--engine-metrics-interval", "0",
            "--drain-seconds", "1",
            "--log-level", self.config.log_level,
        ]  # fmt: skip
        if self.config.api_keys_file is not None:
            argv += ["--api-keys-file", str(self.config.api_keys_file)]
        name = f"extproc-{index}"
        return Supervised(Child(name, argv, self.state_dir / "logs" / f"{name}.log"))

    async def _start_children(self, xds_port: int) -> None:
        """Two extprocs (the active one and a standby, as in `wakegate up`: Envoy's extproc cluster
        holds them as priorities 0 and 1) and Envoy, each restarted when it exits."""
        extprocs, admins, activators = (
            [free_port(), free_port()],
            [free_port(), free_port()],
            [free_port(), free_port()],
        )
        self.extproc_admins = admins
        self.envoy_admin = self.state_dir / "run" / "envoy-admin.sock"
        self.envoy_admin.parent.mkdir(parents=True, exist_ok=True)
        envoy = local_gateway.envoy(
            self.state_dir,
            self.node_id,
            bootstrap.GatewayPorts(
                envoy_admin=0,
                xds=xds_port,
                extproc=extprocs[0],
                extproc_standby=extprocs[1],
                activator=activators[0],
                activator_standby=activators[1],
                admin_socket=str(self.envoy_admin),
            ),
            self.token.file,
            self.envoy_admin,
        )
        self._children = [
            *(self._extproc(i, extprocs[i], admins[i], activators[i], xds_port) for i in range(2)),
            envoy,
        ]
        for child in self._children:
            await child.start()
            self._watchers.append(asyncio.ensure_future(self._watch(child)))

    async def _watch(self, child: Supervised) -> None:
        try:
            await child.run()
        except CrashLoop as exc:
            log.error("%s", exc)
            self.failed = True
            self.stop.set()

    async def _wait_ready(self) -> bool:
        """Whether the gateway serves, as `wakegate up` checks it (`local_gateway.wait_ready`)."""
        try:
            async with local_gateway.admin_session(None, self.envoy_admin) as envoy_admin:
                return await local_gateway.wait_ready(
                    (self.gateway.listen_host, self.gateway.listen_port),
                    self.extproc_admins,
                    envoy_admin,
                    self.stop,
                    self.state_dir / "logs" / "envoy.log",
                )
        except local_gateway.GatewayNotReady as exc:
            log.error("%s", exc)
            return False

    # -- status ----------------------------------------------------------------------------------

    def proxy_status(self) -> dict[str, Any]:
        """The GlobalProxy's status: its members as this gateway sees them."""
        healthy = sum(1 for name in self.members if self.health.get(name, MemberHealth()).reachable)
        return {"members": len(self.members), "healthyMembers": healthy}

    def status(self) -> dict[str, Any]:
        return {
            "gateway": f"http://{self.gateway.listen_host}:{self.gateway.listen_port}",
            "members": {
                name: fed.cluster_status(self.health[name], self.seen_at.get(name)) for name in sorted(self.members)
            },
            "models": {
                fed.model_key(m): fed.federated_status(m, self.members.values(), self.health) for m in self.models
            },
            "routes": self._routed_now(),
            "waking": {key: w.member for key, w in self._wakes.items()},
            "components": {
                c.child.name: {"pid": c.child.pid, "running": c.child.running, "restarts": c.restarts}
                for c in self._children
            },
            "counters": {
                "probes": self.counters.probes,
                "probe_failures": self.counters.probe_failures,
                "failovers": self.counters.failovers,
                "wakes": dict(self.counters.wakes),
                "wake_failures": self.counters.wake_failures,
            },
        }

    def _routed_now(self) -> dict[str, list[str]]:
        """Per model, the members the global extprocs may send a request to now: the routes they
        acknowledged, so a member is listed until they have dropped it (and from when they have
        it). Before the ADS server runs: the routes as computed."""
        ads = self.publisher.ads
        held = ads.retained(self.node_id) if ads is not None else None
        return {
            r.key: sorted(self._names(r.endpoints if held is None else tuple(held.get(r.cluster, ()))))
            for r in self._routes
        }

    async def _serve_admin(self) -> web.AppRunner | None:
        if self.config.admin_listen is None:
            return None

        async def status(_: web.Request) -> web.Response:
            return web.json_response(self.status())

        async def healthz(_: web.Request) -> web.Response:
            return web.json_response({"status": "ok"})

        host, port = self.config.admin_listen
        return await admin.serve({"/status": status, "/healthz": healthz}, host, port)

    # -- the run ---------------------------------------------------------------------------------

    async def run(self) -> int:
        self._session = aiohttp.ClientSession()
        server = None
        runner = None
        try:
            await self.publisher.publish()
            server, self.publisher.ads, xds_port = await start_server(
                self.publisher.cache,
                "127.0.0.1:0",
                extra=lambda s: demand_pb2_grpc.add_DemandServiceServicer_to_server(self.demand, s),
                on_endpoints_acked=self.publisher.publish_soon,
                authenticator=self.authenticator,
            )
            self._probers = {name: asyncio.ensure_future(self._probe_loop(name)) for name in self.members}
            runner = await self._serve_admin()
            await self._start_children(xds_port)
            if not await self._wait_ready():
                return 1
            print(
                f"wakegate federation: global gateway serving on http://{self.gateway.listen_host}:"
                f"{self.gateway.listen_port} members={','.join(sorted(self.members))}",
                flush=True,
            )
            await self.stop.wait()
            return 1 if self.failed else 0
        finally:
            for task in [*self._probers.values(), *(w.task for w in self._wakes.values())]:
                task.cancel()
            for watcher in self._watchers:
                watcher.cancel()
            for child in reversed(self._children):  # Envoy first: nothing new is admitted
                await child.stop(5.0)
            if runner is not None:
                await runner.cleanup()
            if server is not None:
                await server.stop(1)
            await self._session.close()
