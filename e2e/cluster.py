"""A real Kubernetes control plane on 127.0.0.1, plus the e2e node agent.

    python -m e2e.cluster up --dir DIR [--nodes 2]    # foreground; Ctrl-C stops it
    python -m e2e.cluster down --dir DIR              # stop one left running (pytest --keep)

`up` prints `ready DIR/kubeconfig` once /readyz passes and the nodes are Ready.
Ports and the pod range (a 10.X.0.0/16, one network namespace per node, see
e2e/net.py) are picked free at start, so two clusters can run side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from e2e import build, net
from e2e.pki import PKI, Pair
from e2e.procs import Proc, group_alive, stop_all, stop_group
from wakegate.control.admin import free_port

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

REPO_ROOT = Path(__file__).resolve().parent.parent

#: Only an allocation range inside the apiserver (Service ClusterIPs); nothing
#: routes it here, so tests must talk to pod IPs, never to ClusterIPs.
SERVICE_CIDR = "10.96.0.0/16"

#: kube-controller-manager controllers the e2e tests rely on. Node IPAM, cloud,
#: volume, CSR and bootstrap-token controllers stay off: nothing here needs them.
CONTROLLERS = (
    "deployment-controller",
    "replicaset-controller",
    "statefulset-controller",
    "daemonset-controller",
    "job-controller",
    "cronjob-controller",
    "ttl-after-finished-controller",
    "endpoints-controller",
    "endpointslice-controller",
    "endpointslice-mirroring-controller",
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller",
    "disruption-controller",
    "pod-garbage-collector-controller",
    "node-lifecycle-controller",
    "taint-eviction-controller",
    "clusterrole-aggregation-controller",
    "resourcequota-controller",
    "horizontal-pod-autoscaler-controller",
)

#: kube-controller-manager's HPA sync period here (default 15 s).
HPA_SYNC_SECONDS = 2

Log = Callable[[str], None]


def _log(msg: str) -> None:
    print(f"[e2e.cluster] {msg}", file=sys.stderr, flush=True)


class ClusterError(RuntimeError):
    pass


class Cluster:
    """etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the node agent.

    `keep=True` leaves the processes free to outlive this Python process (used by
    pytest --keep); otherwise the kernel kills them if we die without stop().
    """

    def __init__(
        self,
        dir: Path,
        nodes: int = 2,
        node_spec: Path | None = None,
        scheduler_config: Path | None = None,
        apiserver_args: Sequence[str] = (),
        pod_cidr: str | None = None,
        agent_args: Sequence[str] = (),
        keep: bool = False,
        log: Log = _log,
    ) -> None:
        self.dir = dir.resolve()
        self.nodes = nodes
        self.node_spec = node_spec
        self.scheduler_config = scheduler_config
        self.apiserver_args = list(apiserver_args)
        self.agent_args = list(agent_args)
        self.keep = keep
        self.log = log
        self.procs: list[Proc] = []
        self.ports: dict[str, int] = {}
        #: the cluster's pod range (10.X.0.0/16 unless given); node i gets its i-th /24
        self.pod_cidr = pod_cidr
        #: namespaces, veths and addresses of the nodes (e2e/net.py); set once started or attached
        self.network: net.ClusterNet | None = None
        self._owns_network = False

    @classmethod
    def attach(cls, dir: Path) -> Cluster:
        """A handle on a cluster already running in `dir` (from `up` or pytest --keep)."""
        state = json.loads((dir / "cluster.json").read_text())
        if not all(group_alive(pgid) for pgid in state["pgids"].values()):
            raise ClusterError(f"the cluster in {dir} is not (fully) running")
        cluster = cls(dir, pod_cidr=state["pod_cidr"], keep=True)
        cluster.ports = state["ports"]
        cluster.nodes = state["nodes"]
        if "network" in state:
            cluster.network = net.ClusterNet.from_dict(state["network"])  # not ours to remove
        return cluster

    @staticmethod
    def running_in(dir: Path) -> bool:
        state_file = dir / "cluster.json"
        if not state_file.exists():
            return False
        pgids = json.loads(state_file.read_text()).get("pgids", {})
        return bool(pgids) and all(group_alive(pgid) for pgid in pgids.values())

    # -- paths -------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    @property
    def pki_dir(self) -> Path:
        return self.dir / "pki"

    @property
    def state_file(self) -> Path:
        return self.dir / "cluster.json"

    @property
    def network_file(self) -> Path:
        return self.dir / "network.json"

    def node_netns(self, node: str | int) -> str:
        """The network namespace of a node (its name or index), e.g. for `ip netns exec`."""
        assert self.network is not None, "cluster not started"
        if isinstance(node, int):
            return self.network.nodes[node].netns
        names = self._node_names()
        return self.network.nodes[names.index(node)].netns

    def _node_names(self) -> list[str]:
        from e2e.nodes import default_nodes, load_nodes

        specs = load_nodes(self.node_spec) if self.node_spec is not None else default_nodes(self.nodes)
        return [spec.name for spec in specs]

    # -- lifecycle ---------------------------------------------------------

    def start(self, timeout: float = 120.0) -> None:
        started = time.monotonic()
        deadline = started + timeout
        bins = build.ensure_built(log=self.log)
        self._reset_dir()
        if self.node_spec is not None:
            self.nodes = len(self._node_names())
        for name in ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler"):
            self.ports[name] = free_port()
        pki = PKI(self.pki_dir)
        serving = pki.issue("serving", "kube-apiserver", server=True)
        admin = pki.issue("admin", "kubernetes-admin", org="system:masters")
        front_proxy = pki.issue("front-proxy-client", "front-proxy-client")
        sa = pki.service_account_keys()
        pki.kubeconfig(self.kubeconfig, self.server, admin, "admin")
        kcm_kubeconfig = pki.kubeconfig(
            self.pki_dir / "controller-manager.kubeconfig", self.server,
            pki.issue("controller-manager", "system:kube-controller-manager"),
            "system:kube-controller-manager",
        )
        sched_kubeconfig = pki.kubeconfig(
            self.pki_dir / "scheduler.kubeconfig", self.server,
            pki.issue("scheduler", "system:kube-scheduler"), "system:kube-scheduler",
        )
        try:
            self._create_network()
            self._start_etcd(bins, deadline)
            self._start_apiserver(bins, pki, serving, front_proxy, sa.key, sa.cert, deadline)
            self._start_controller_manager(bins, pki, serving, kcm_kubeconfig, sa.key)
            self._start_scheduler(bins, serving, sched_kubeconfig)
            self._start_agent()
            self._write_state()
            self._install_crds(deadline)
            self._wait_healthz("controller-manager", deadline)
            self._wait_healthz("scheduler", deadline)
            self._wait_nodes_ready(deadline)
        except BaseException:
            self.stop()
            raise
        self.log(f"cluster up in {time.monotonic() - started:.1f}s: {self.kubeconfig}")

    def _reset_dir(self) -> None:
        """Start from a clean slate: old certs or etcd data would not match the new cluster."""
        if self.state_file.exists():
            pgids = json.loads(self.state_file.read_text()).get("pgids", {})
            if any(group_alive(pgid) for pgid in pgids.values()):
                raise ClusterError(f"a cluster is still running in {self.dir}; stop it with `down --dir`")
        self.dir.mkdir(parents=True, exist_ok=True)
        # Only what we create here, so a --dir pointed at the wrong place loses nothing else.
        for sub in ("etcd", "pki", "agent", "logs"):
            shutil.rmtree(self.dir / sub, ignore_errors=True)
        for name in ("kubeconfig", "cluster.json", "network.json"):
            (self.dir / name).unlink(missing_ok=True)
        (self.dir / "logs").mkdir()

    def _create_network(self) -> None:
        try:
            self.network = net.create(self.nodes, self.pod_cidr, owner=os.getpid(), log=self.log)
        except net.NetError as exc:
            raise ClusterError(f"cannot set up the pod network: {exc}") from exc
        self._owns_network = True
        self.pod_cidr = self.network.cidr
        self.network.save(self.network_file)
        self.log(f"pod network {self.network.cidr}: " + ", ".join(
            f"{n.netns} {n.cidr}" for n in self.network.nodes))

    def _destroy_network(self) -> None:
        if self.network is not None and self._owns_network:
            net.destroy(self.network)
            self._owns_network = False

    def stop(self) -> None:
        if not self.procs and not self._owns_network:
            return  # nothing started here (or attached to someone else's cluster): leave its state alone
        # The agent first so pods end while the apiserver still answers, etcd last.
        by_name = {p.name: p for p in self.procs}
        for batch, grace in (
            (["node-agent"], 5.0),
            (["kube-scheduler", "kube-controller-manager"], 3.0),
            (["kube-apiserver"], 5.0),
            (["etcd"], 3.0),
        ):
            stop_all([by_name[n] for n in batch if n in by_name], grace)
        self.procs.clear()
        # Last: no pod is left in the namespaces.
        self._destroy_network()
        self.state_file.unlink(missing_ok=True)

    def detach(self) -> None:
        """Leave the cluster running after this process exits; stop it with `down --dir`."""
        for proc in self.procs:
            proc.detach()
        self.procs.clear()
        # `down --dir` removes the network (cluster.json names it); until then the
        # components' PIDs in its record keep a later start from reaping it.
        self._owns_network = False

    def check(self) -> None:
        """Raise if a component died."""
        for proc in self.procs:
            code = proc.exited()
            if code is not None:
                raise ClusterError(f"{proc.name} exited with {code}; last log lines:\n{proc.tail()}")

    def api_client(self) -> ApiClient:
        """A kubernetes ApiClient with cluster-admin rights; close() it when done."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    # -- components --------------------------------------------------------

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        # PR_SET_PDEATHSIG fires when the forking *thread* ends, so only tie
        # components to us when started from the main thread.
        tie = not self.keep and threading.current_thread() is threading.main_thread()
        proc = Proc(name, argv, self.dir / "logs" / f"{name}.log", env=env, tie_to_parent=tie)
        proc.start()
        self.procs.append(proc)
        return proc

    def _start_etcd(self, bins: Path, deadline: float) -> None:
        client = f"http://127.0.0.1:{self.ports['etcd']}"
        peer = f"http://127.0.0.1:{self.ports['etcd-peer']}"
        self._spawn("etcd", [
            str(bins / "etcd"),
            "--name=e2e",
            f"--data-dir={self.dir / 'etcd'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=e2e={peer}",
            # Throwaway data: fsync only costs time on a busy 2-core machine.
            "--unsafe-no-fsync=true",
            "--log-level=warn",
        ])
        self._poll("etcd", deadline, lambda: self._get(f"{client}/health") is not None)

    def _start_apiserver(
        self, bins: Path, pki: PKI, serving: Pair, front_proxy: Pair, sa_key: Path, sa_pub: Path,
        deadline: float,
    ) -> None:
        self._spawn("kube-apiserver", [
            str(bins / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={self.ports['apiserver']}",
            f"--cert-dir={self.pki_dir}",
            f"--tls-cert-file={serving.cert}",
            f"--tls-private-key-file={serving.key}",
            f"--client-ca-file={pki.ca.cert}",
            "--authorization-mode=Node,RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={sa_pub}",
            f"--service-account-signing-key-file={sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # 127.0.0.1 may not be an Endpoints address; nothing needs the
            # `kubernetes` Service to have endpoints here.
            "--endpoint-reconciler-type=none",
            "--allow-privileged=true",
            # The aggregation layer (metrics APIs, KEDA's metrics server) with
            # endpoint routing: Service ClusterIPs are not routable here, pod IPs are.
            f"--requestheader-client-ca-file={pki.ca.cert}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={front_proxy.cert}",
            f"--proxy-client-key-file={front_proxy.key}",
            "--enable-aggregator-routing=true",
            "--profiling=false",
            "--v=1",
            *self.apiserver_args,
        ])
        self._poll("kube-apiserver /readyz", deadline, lambda: self._get(f"{self.server}/readyz") == "ok")

    def _start_controller_manager(
        self, bins: Path, pki: PKI, serving: Pair, kubeconfig: Path, sa_key: Path
    ) -> None:
        self._spawn("kube-controller-manager", [
            str(bins / "kube-controller-manager"),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.ports['controller-manager']}",
            f"--tls-cert-file={serving.cert}",
            f"--tls-private-key-file={serving.key}",
            f"--controllers={','.join(CONTROLLERS)}",
            # One token per controller, as kubeadm runs it: RBAC of each
            # controller is exercised for real.
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={sa_key}",
            f"--root-ca-file={pki.ca.cert}",
            "--cluster-name=e2e",
            # A single instance: skip the lease dance and start controllers at once.
            "--leader-elect=false",
            # HPAs (KEDA's, through its external metrics APIService) act within seconds, not the
            # default 15 s, so 1 -> N -> 1 fits an e2e test.
            f"--horizontal-pod-autoscaler-sync-period={HPA_SYNC_SECONDS}s",
            "--v=1",
        ])

    def _start_scheduler(self, bins: Path, serving: Pair, kubeconfig: Path) -> None:
        argv = [
            str(bins / "kube-scheduler"),
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.ports['scheduler']}",
            f"--tls-cert-file={serving.cert}",
            f"--tls-private-key-file={serving.key}",
            "--v=1",
        ]
        if self.scheduler_config is None:
            argv += [f"--kubeconfig={kubeconfig}", "--leader-elect=false"]
        else:
            # A KubeSchedulerConfiguration names its own clientConnection.kubeconfig
            # and leaderElection; pass `{kubeconfig}` in it to get ours.
            text = self.scheduler_config.read_text().replace("{kubeconfig}", str(kubeconfig))
            config = self.pki_dir / "scheduler-config.yaml"
            config.write_text(text)
            argv.append(f"--config={config}")
        self._spawn("kube-scheduler", argv)

    def _start_agent(self) -> None:
        env = dict(os.environ)
        # e2e is not an installed package; the agent imports it from the checkout.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        argv = [
            sys.executable, "-m", "e2e.nodeagent",
            f"--kubeconfig={self.kubeconfig}",
            f"--nodes={self.nodes}",
            f"--work-dir={self.dir / 'agent'}",
            f"--network={self.network_file}",
        ]
        if self.node_spec is not None:
            argv.append(f"--node-spec={self.node_spec}")
        self._spawn("node-agent", argv + self.agent_args, env=env)

    # -- readiness -----------------------------------------------------------

    def _ssl(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki_dir / "ca.crt"))
        ctx.load_cert_chain(str(self.pki_dir / "admin.crt"), str(self.pki_dir / "admin.key"))
        return ctx

    def _get(self, url: str) -> str | None:
        """Body of a 200 answer, None for anything else (refused, 5xx, TLS not up yet)."""
        try:
            ctx = self._ssl() if url.startswith("https") else None
            with urllib.request.urlopen(url, timeout=2, context=ctx) as resp:
                body: str = resp.read().decode()
                return body
        except (OSError, urllib.error.URLError, ssl.SSLError):
            return None

    def _poll(self, what: str, deadline: float, ok: Callable[[], bool], every: float = 0.2) -> None:
        while True:
            self.check()
            if ok():
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out waiting for {what}; logs in {self.dir / 'logs'}")
            time.sleep(every)

    def _wait_healthz(self, name: str, deadline: float) -> None:
        url = f"https://127.0.0.1:{self.ports[name]}/healthz"
        self._poll(f"{name} /healthz", deadline, lambda: self._get(url) == "ok")

    def _install_crds(self, deadline: float) -> None:
        import yaml
        from kubernetes import client

        with self.api_client() as api:
            ext = client.ApiextensionsV1Api(api)
            names = []
            for path in sorted(build.CRD_DIR.glob("*.yaml")):
                body = yaml.safe_load(path.read_text())
                ext.create_custom_resource_definition(body)
                names.append(body["metadata"]["name"])

            def established() -> bool:
                for name in names:
                    crd = ext.read_custom_resource_definition(name)
                    conds = {c.type: c.status for c in (crd.status.conditions or [])}
                    if conds.get("Established") != "True":
                        return False
                return True

            self._poll("KEDA CRDs established", deadline, established)

    def _wait_nodes_ready(self, deadline: float) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        with self.api_client() as api:
            core = client.CoreV1Api(api)

            def ready() -> bool:
                nodes = core.list_node().items
                count = sum(
                    1 for n in nodes
                    for c in (n.status.conditions or []) if c.type == "Ready" and c.status == "True"
                )
                if count < self.nodes:
                    return False
                # Pods are refused until the serviceaccount controller made `default`.
                try:
                    core.read_namespaced_service_account("default", "default")
                except ApiException:
                    return False
                return True

            self._poll(f"{self.nodes} Ready nodes", deadline, ready, every=0.3)

    def _write_state(self) -> None:
        state = {
            "kubeconfig": str(self.kubeconfig),
            "server": self.server,
            "pod_cidr": self.pod_cidr,
            "network": self.network.to_dict() if self.network is not None else None,
            "nodes": self.nodes,
            "ports": self.ports,
            # Each component leads its own process group (start_new_session).
            "pgids": {p.name: p.pid for p in self.procs},
        }
        self.state_file.write_text(json.dumps(state, indent=2) + "\n")
        if self.network is not None:
            # While any component lives the network is in use, even after we exit (--keep).
            net.set_owners(self.network, [os.getpid(), *(p.pid for p in self.procs)])


def down(dir: Path) -> int:
    """Stop a cluster left running by `pytest --keep` (or a killed `up`)."""
    state_file = dir / "cluster.json"
    if not state_file.exists():
        _log(f"no cluster state in {dir}")
        return 1
    state = json.loads(state_file.read_text())
    pgids: dict[str, int] = state["pgids"]
    for name in ("node-agent", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
        pgid = pgids.get(name)
        if pgid is not None and group_alive(pgid):
            _log(f"stopping {name} (pgid {pgid})")
            stop_group(pgid, grace=5.0)
    if state.get("network"):
        network = net.ClusterNet.from_dict(state["network"])
        _log(f"removing pod network {network.cidr} ({', '.join(n.netns for n in network.nodes)})")
        net.destroy(network)
    state_file.unlink()
    return 0


class _Stop(Exception):
    pass


def up(args: argparse.Namespace) -> int:
    cluster = Cluster(
        Path(args.dir), nodes=args.nodes,
        node_spec=Path(args.node_spec) if args.node_spec else None,
        scheduler_config=Path(args.scheduler_config) if args.scheduler_config else None,
    )
    stop_requested = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop_requested.set()
        # Interrupts a start() still in progress; once up, the loop below sees the flag.
        if not started:
            raise _Stop()

    started = False
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        cluster.start(timeout=args.timeout)
        started = True
        print(f"ready {cluster.kubeconfig}", flush=True)
        while not stop_requested.wait(0.5):
            cluster.check()
    except _Stop:
        return 0
    except (ClusterError, build.BuildError) as exc:
        _log(str(exc))
        return 1
    finally:
        # No second signal may cut the cleanup short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _log("stopping")
        cluster.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.cluster", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="start a cluster and run it in the foreground")
    p_up.add_argument("--dir", required=True, help="state directory (certs, etcd data, logs, kubeconfig)")
    p_up.add_argument("--nodes", type=int, default=2, help="fake GPU nodes to register (default 2)")
    p_up.add_argument("--node-spec", help="YAML list of nodes (name, labels, capacity) instead of defaults")
    p_up.add_argument("--scheduler-config", help="KubeSchedulerConfiguration; `{kubeconfig}` is substituted")
    p_up.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for readiness")
    p_down = sub.add_parser("down", help="stop a cluster left running (pytest --keep)")
    p_down.add_argument("--dir", required=True)
    args = parser.parse_args(argv)
    if args.cmd == "down":
        return down(Path(args.dir))
    return up(args)


if __name__ == "__main__":
    sys.exit(main())
