"""`wakegate federation`: one global endpoint over several member gateways.

`wakegate federation gateway -f FILE` runs the global gateway (control/federation/gateway.py)
from a file of Cluster, FederatedModel and GlobalProxy documents; `wakegate federation
controller` writes the FederatedModels' Models into the member clusters and their status back
(control/federation/controller.py). docs/federation.md has the whole picture.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wakegate.control.federation.gateway import GatewayConfig, GlobalGateway
from wakegate.control.federation.kube import proxy_path, read_federation
from wakegate.control.federation.members import member_of
from wakegate.control.federation.probe import ProbeFailed, TlsFiles, TlsMaterial, client_context
from wakegate.control.federation_schema import Federation, parse_federation
from wakegate.control.k8s.client import add_kubeconfig
from wakegate.control.manifests import ManifestError
from wakegate.process import ProcessSettings, add_log_level, graceful_exit, host_port, log_level, settings_from, start

log = logging.getLogger("wakegate.federation")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="role", metavar="ROLE", required=True)
    gateway = sub.add_parser("gateway", help="the global gateway: Envoy + extproc over the member gateways")
    source = gateway.add_mutually_exclusive_group(required=True)
    source.add_argument("-f", "--file", type=Path, help="Cluster, FederatedModel and GlobalProxy documents (YAML)")
    source.add_argument(
        "--proxy",
        metavar="NAMESPACE/NAME",
        help="a GlobalProxy on the federation cluster (--kubeconfig): its Clusters and the FederatedModels "
        "of its namespace, re-read every --refresh seconds",
    )
    add_kubeconfig(gateway)
    gateway.add_argument("--refresh", type=float, default=5.0, help="seconds between reads of the cluster (--proxy)")
    gateway.add_argument("--state-dir", type=Path, default=Path(".wakegate-global"), help="logs and rendered configs")
    gateway.add_argument(
        "--admin-listen", default=None, help="HTTP address of /status and /healthz (HOST:PORT); none by default"
    )
    gateway.add_argument(
        "--upstream-header", action="store_true", help="add x-wakegate-upstream (the member's address) to responses"
    )
    controller = sub.add_parser(
        "controller", help="write FederatedModels' Models into the member clusters, statuses back"
    )
    add_kubeconfig(controller)
    controller.add_argument("--interval", type=float, default=5.0, help="seconds between passes")
    controller.add_argument("--probe-timeout", type=float, default=2.0, help="a member gateway slower is unreachable")
    for role in (gateway, controller):
        # Either place: `wakegate federation --log-level X ROLE …` or `… ROLE --log-level X`.
        role.add_argument("--log-level", type=log_level, default=argparse.SUPPRESS, metavar="LEVEL", help="as above")
    add_log_level(parser)


@dataclass(frozen=True, kw_only=True)
class Settings(ProcessSettings):
    """Everything `wakegate federation gateway` is configured with; built once from its command line."""

    federation: Federation | None
    """The documents of --file, validated; None: read from the cluster (--proxy)."""
    proxy: tuple[str, str] | None
    """The GlobalProxy's namespace and name on the federation cluster; None: --file."""
    kubeconfig: str | None
    """The federation cluster (--proxy)."""
    refresh: float
    """Seconds between reads of the federation cluster."""
    token_files: dict[str, Path]
    """Member token files by cluster, relative names resolved against the file's folder."""
    tls_files: dict[str, TlsFiles]
    """Member TLS files by cluster (caFile, clientCertFile, clientKeyFile), resolved likewise."""
    api_keys_file: Path | None
    """The clients' API keys (GlobalProxy spec.auth.apiKeysFile); None: no auth."""
    state_dir: Path
    """Logs, the internal token and Envoy's bootstrap."""
    admin_listen: tuple[str, int] | None
    """/status and /healthz; None: not served."""
    upstream_header: bool
    """Add x-wakegate-upstream to responses."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        """Raises ValueError with a message for the user: a missing or invalid file, a bad address."""
        admin = host_port(args.admin_listen, "127.0.0.1") if args.admin_listen is not None else None
        if args.proxy is not None:
            namespace, slash, name = args.proxy.partition("/")
            if not (namespace and slash and name):
                raise ValueError("--proxy must be NAMESPACE/NAME")
            if args.refresh <= 0:
                raise ValueError("--refresh must be positive")
            return settings_from(
                cls,
                args,
                federation=None,
                proxy=(namespace, name),
                token_files={},
                tls_files={},
                api_keys_file=None,
                admin_listen=admin,
            )
        try:
            federation = parse_federation(args.file.read_text(encoding="utf-8"), str(args.file))
        except OSError as exc:
            raise ValueError(f"cannot read {args.file}: {exc.strerror}") from None
        except ManifestError as exc:
            raise ValueError(str(exc)) from None
        folder = args.file.resolve().parent
        tokens = {}
        tls = {}
        for cluster in federation.clusters:
            member_of(cluster)  # a URL the global Envoy can use, or a ValueError naming the Cluster
            gateway = cluster.spec.gateway
            if gateway.tokenFile is not None:
                tokens[cluster.name] = folder / gateway.tokenFile
            if gateway.ca is not None or gateway.clientCert is not None:
                raise ValueError(
                    f"Cluster {cluster.name!r}: gateway.ca and gateway.clientCert are Secrets (--proxy); "
                    "in a file use caFile, clientCertFile and clientKeyFile"
                )
            if gateway.caFile is not None:
                files = TlsFiles(
                    folder / gateway.caFile,
                    folder / gateway.clientCertFile if gateway.clientCertFile else None,
                    folder / gateway.clientKeyFile if gateway.clientKeyFile else None,
                )
                try:
                    client_context(files.read())  # readable, and PEM that loads: else the CLI says so now
                except ProbeFailed as exc:
                    raise ValueError(f"Cluster {cluster.name!r}: {exc}") from None
                tls[cluster.name] = files
        keys = federation.proxy.spec.auth.apiKeysFile
        return settings_from(
            cls,
            args,
            federation=federation,
            proxy=None,
            token_files=tokens,
            tls_files=tls,
            api_keys_file=folder / keys if keys is not None else None,
            admin_listen=admin,
        )


@dataclass(frozen=True, kw_only=True)
class ControllerSettings(ProcessSettings):
    """Everything `wakegate federation controller` is configured with."""

    kubeconfig: str | None
    """The federation's own cluster (Clusters, FederatedModels, their Secrets)."""
    interval: float
    """Seconds between passes."""
    probe_timeout: float
    """A member gateway that answers slower counts as unreachable."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ControllerSettings:
        if not 0 < args.probe_timeout <= args.interval:
            raise ValueError("--probe-timeout must be positive and at most --interval")
        return settings_from(cls, args)


def main(args: argparse.Namespace) -> int:
    if args.role == "controller":
        return start(
            args, ControllerSettings.from_args, lambda s: asyncio.run(_control(s)), "federation", quiet=("kubernetes",)
        )
    return start(args, Settings.from_args, lambda settings: asyncio.run(_run(settings)), "federation")


async def _control(settings: ControllerSettings) -> int:
    from wakegate.control.federation.controller import Controller
    from wakegate.control.k8s.client import Kube, api_client

    stop = asyncio.Event()
    graceful_exit(stop, "federation")
    controller = Controller(Kube(api_client(settings.kubeconfig)), settings.interval, settings.probe_timeout)
    print("wakegate federation: controller running", flush=True)
    await controller.run(stop)
    return 0


async def _run(settings: Settings) -> int:
    host = None
    federation = settings.federation
    tokens: dict[str, str] = {}
    tls: dict[str, TlsMaterial] = {}
    refused: set[str] = set()

    def refuse(what: str, why: str) -> None:
        if what not in refused:
            refused.add(what)
            log.warning("federation: skipping %s: %s", what, why)

    if settings.proxy is not None:
        from wakegate.control.k8s.client import Kube, KubeError, api_client

        host = Kube(api_client(settings.kubeconfig))
        try:
            federation, tokens, tls = await read_federation(host, *settings.proxy, refuse)
        except KubeError as exc:
            print(f"wakegate federation: cannot read GlobalProxy {'/'.join(settings.proxy)}: {exc}", flush=True)
            return 1
    assert federation is not None
    gateway = GlobalGateway(
        GatewayConfig(
            federation=federation,
            token_files=settings.token_files,
            state_dir=settings.state_dir.resolve(),
            api_keys_file=settings.api_keys_file,
            admin_listen=settings.admin_listen,
            upstream_header=settings.upstream_header,
            log_level=settings.log_level,
            tls_files=settings.tls_files,
        )
    )
    gateway.member_tokens = tokens
    gateway.member_tls = tls
    graceful_exit(gateway.stop, "federation")
    follower = None
    if host is not None and settings.proxy is not None:
        follower = asyncio.ensure_future(_follow(host, settings.proxy, settings.refresh, gateway, refuse))
    try:
        return await gateway.run()
    finally:
        if follower is not None:
            follower.cancel()


async def _follow(
    host: Any, proxy: tuple[str, str], refresh: float, gateway: GlobalGateway, refuse: Callable[[str, str], None]
) -> None:
    """Re-read the federation cluster every `refresh` seconds; write the GlobalProxy's status."""
    from wakegate.control.k8s.client import KubeError

    while True:
        await asyncio.sleep(refresh)
        try:
            federation, tokens, tls = await read_federation(host, *proxy, refuse)
            gateway.update(federation, tokens, tls)
            await asyncio.to_thread(host.patch_status, proxy_path(*proxy), gateway.proxy_status())
        except KubeError as exc:
            log.warning("federation: cannot read the federation cluster: %s", exc)
