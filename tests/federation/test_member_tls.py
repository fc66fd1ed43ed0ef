"""The global gateway speaks TLS to https:// member gateways: a real `wakegate up` member behind
real TLS terminators (static Envoys with a DownstreamTlsContext), certificates made here.

What a user who puts member gateways behind TLS relies on: requests through the global gateway
reach a member over TLS checked against the Cluster's CA (by IP SAN, or by `serverName` as SNI
and DNS SAN); a member presenting a certificate from another CA is never used and its status
says why; a terminator that requires client certificates takes the Cluster's and refuses a
Cluster without one. No key or certificate text reaches a log line or /status.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from e2e.pki import PKI, Pair
from tests.support.federation import GlobalProcess, chat, member_port, refused_at_start
from tests.support.http import Response
from tests.support.processes import stop_process
from tests.support.up import UpProcess, model_doc
from wakegate.control import bootstrap
from wakegate.control.admin import free_port

INTERVAL = 0.5


def _listener(name: str, port: int, upstream: int, server: Pair, client_ca: Path | None) -> str:
    validation = (
        f"""
            validation_context: {{trusted_ca: {{filename: "{client_ca}"}}}}
          require_client_certificate: true"""
        if client_ca is not None
        else ""
    )
    return f"""
  - name: {name}
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
          common_tls_context:
            tls_certificates:
            - certificate_chain: {{filename: "{server.cert}"}}
              private_key: {{filename: "{server.key}"}}{validation}
      filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: {name}
          cluster: member"""


class Terminator:
    """A static Envoy ending TLS on one port per Cluster (requiring a client certificate from
    `client_ca` where asked) and passing the bytes on to the member gateway on `upstream`."""

    def __init__(self, tmp: Path, upstream: int, server: Pair, client_ca: Path, mutual: dict[str, bool]) -> None:
        self.ports = {name: free_port() for name in mutual}
        listeners = "".join(
            _listener(name, self.ports[name], upstream, server, client_ca if required else None)
            for name, required in mutual.items()
        )
        config = tmp / "terminator.yaml"
        config.write_text(f"""
static_resources:
  listeners:{listeners}
  clusters:
  - name: member
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: member
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {upstream}}}}}}}
""")
        self._log = open(tmp / "terminator.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [bootstrap.envoy_binary(), "-c", str(config), "--concurrency", "1", "--use-dynamic-base-id",
             "--log-level", "warn", "--disable-hot-restart"],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip

    def stop(self) -> None:
        stop_process(self.proc, self._log, signal.SIGTERM, 10)


def cluster_doc(name: str, port: int, gateway: str) -> str:
    return f"""apiVersion: wakegate.io/v1alpha1
kind: Cluster
metadata: {{name: {name}, labels: {{tier: gpu}}}}
spec: {{gateway: {{url: "https://127.0.0.1:{port}", {gateway}}}}}
"""


@dataclass
class Setup:
    member: UpProcess
    glob: GlobalProcess
    ports: dict[str, int]

    def member_of(self, response: Response) -> str:
        return next(name for name, p in self.ports.items() if p == member_port(response))


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    servers, clients, other = PKI(tmp_path / "servers"), PKI(tmp_path / "clients"), PKI(tmp_path / "other")
    server = servers.issue("east", "east gateway", server=True, extra_sans=["east.example"])
    client = clients.issue("global", "global gateway")
    started: list[UpProcess | GlobalProcess | Terminator] = []
    try:
        member = UpProcess(
            tmp_path,
            model_doc("chat", extra="  servedName: org/chat\n  aliases: [small]\n  scaling: {min: 1, max: 1}\n"),
        )
        started.append(member)
        # Four ways to the same member, each its own TLS port: TLS checked by IP SAN, mTLS by
        # serverName, mTLS without a client certificate, TLS against the wrong CA.
        mutual = {"ip": False, "named": True, "nocert": True, "wrongca": False}
        terminator = Terminator(tmp_path, member.port, server, clients.ca.cert, mutual)
        started.append(terminator)
        member.wait_ready()
        ca = f"caFile: {servers.ca.cert}"
        client_files = f"clientCertFile: {client.cert}, clientKeyFile: {client.key}"
        ports = terminator.ports
        clusters = {
            "ip": (ports["ip"], ca),
            "named": (ports["named"], f"{ca}, serverName: east.example, {client_files}"),
            "nocert": (ports["nocert"], f"{ca}, serverName: east.example"),
            "wrongca": (ports["wrongca"], f"caFile: {other.ca.cert}"),
        }

        def document(port: int) -> str:
            docs = [cluster_doc(name, p, gateway) for name, (p, gateway) in clusters.items()]
            docs.append("""apiVersion: wakegate.io/v1alpha1
kind: FederatedModel
metadata: {name: chat}
spec:
  template: {backend: sim, servedName: org/chat, aliases: [small]}
  placement: {clusterSelector: {tier: gpu}}
""")
            docs.append(f"""apiVersion: wakegate.io/v1alpha1
kind: GlobalProxy
metadata: {{name: global}}
spec:
  listeners: [{{address: 127.0.0.1, port: {port}}}]
  healthCheck: {{intervalSeconds: {INTERVAL}, timeoutSeconds: {INTERVAL}}}
""")
            return "---\n".join(docs)

        glob = GlobalProcess(tmp_path, document)
        started.append(glob)
        yield Setup(member, glob, {name: p for name, (p, _) in clusters.items() if name in ("ip", "named")})
    finally:
        for process in reversed(started):
            process.stop()



def test_members_over_tls_are_verified_and_mtls_takes_the_client_certificate(setup: Setup) -> None:
    glob = setup.glob
    status = glob.wait_for(lambda s: s["routes"]["chat"] == ["ip", "named"], timeout=90)
    members = status["members"]
    assert members["ip"]["reachable"] == "True" and members["named"]["reachable"] == "True"
    # The wrong CA: the member's certificate is refused, and its status says so.
    assert members["wrongca"]["reachable"] == "False"
    assert "certificate was refused" in members["wrongca"]["reason"], members["wrongca"]
    # mTLS required, no client certificate: the terminator refuses the connection.
    assert members["nocert"]["reachable"] == "False"
    assert "refused the TLS connection" in members["nocert"]["reason"], members["nocert"]
    assert "no client certificate was presented" in members["nocert"]["reason"]

    # The global Envoy reaches the member through both terminators, over TLS.
    answers = [chat(glob.url, "small") for _ in range(12)]
    assert [a.status for a in answers] == [200] * 12, [a.text for a in answers]
    spread = Counter(setup.member_of(a) for a in answers)
    assert spread["ip"] >= 3 and spread["named"] >= 3, spread
    handshakes = glob.envoy_stats(r"^cluster\.model_chat\.ssl\.handshake$")
    assert sum(handshakes.values()) >= 2, handshakes

    # The reasons stay put while the bad members keep failing, and nothing secret is shown.
    time.sleep(2 * INTERVAL)
    text = str(glob.status()) + glob.log()
    assert "PRIVATE KEY" not in text and "BEGIN CERTIFICATE" not in text
    assert glob.status()["routes"]["chat"] == ["ip", "named"]


@pytest.mark.parametrize(
    ("gateway", "message"),
    [
        ("caFile: missing.pem", "Cluster 'east': tls: cannot read the CA file"),
        ("caFile: servers/ca.key", "Cluster 'east': tls: the CA is not a PEM certificate bundle"),
        (
            "caFile: servers/ca.crt, clientCertFile: clients/global.crt, clientKeyFile: servers/ca.key",
            "Cluster 'east': tls: the client certificate and key do not load as a PEM pair",
        ),
        ("ca: {namespace: a, name: b, key: ca.crt}", "gateway.ca and gateway.clientCert are Secrets (--proxy)"),
    ],
)
def test_bad_tls_material_is_one_line_and_status_2(tmp_path: Path, gateway: str, message: str) -> None:
    PKI(tmp_path / "servers")
    PKI(tmp_path / "clients").issue("global", "global gateway")
    bad = tmp_path / "global.yaml"
    bad.write_text(cluster_doc("east", 1111, gateway))
    done = refused_at_start(bad, tmp_path / "s")
    assert message in done.stderr, done.stderr
    assert "PRIVATE" not in done.stderr and "BEGIN" not in done.stderr
