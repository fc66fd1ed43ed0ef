"""A real Kubernetes node beside the harness's emulated ones: the kubelet, containerd, runc, CNI.

    python -m e2e.node build                                  # kubelet + pause image; prints paths
    python -m e2e.node up --cluster-dir DIR [--registry H:P]  # join a real node to the cluster in DIR

The kubelet is built from `k8s.io/kubernetes` at the control plane's pin, in a Go module of its own
(e2e/node/go: the kubelet needs modules the control plane does not, and adding them to e2e/go
would move its pins). containerd, runc and the CNI plugins are Debian's (e2e/image.py installs
them). The sandbox ("pause") image is built here from the pause.c in the same Kubernetes module,
compiled statically, since registry.k8s.io cannot be reached.

The node lives in a network namespace of its own (like the emulated nodes, e2e/net.py): containerd
runs there, so its CNI bridge, the pods' veths and one DNAT rule stay inside it; a veth pair joins
it to this machine and the cluster routes the node's /24 (the last but one of the pod range) to it.
The kubelet runs on this machine's side and reaches pods through that route (probes). Pods reach
the apiserver, which listens on 127.0.0.1 only, at the `kubernetes` Service IP: the namespace
DNATs 10.96.0.1:443 to a byte relay on the veth's host address (TLS is end to end).

Facts of this machine the configuration follows (docs/testing.md, "A real node"):
- hybrid cgroup v1: kubelet `failCgroupV1: false`, cgroupfs driver in both kubelet and runc;
- no CAP_SYS_RESOURCE: lowering oom_score_adj is refused, and the CRI gives every sandbox -998,
  which runc's init writes before it execs: that failure is `runc create failed: unable to start
  container process: can't get final child's PID from pipe: EOF`. containerd's
  `restrict_oom_score_adj` clamps scores to its own (0), which is allowed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from e2e import image, net
from e2e.build import (
    BIN_DIR,
    BuildError,
    _ldflags,
    go_build,
    go_env,
    go_mod_digest,
    go_version,
    pinned_version,
    required_version,
    stamp_matches,
)
from e2e.pki import PKI
from e2e.procs import Proc, stop_all
from wakegate.control.admin import free_port

if TYPE_CHECKING:
    from e2e.cluster import Cluster

HERE = Path(__file__).resolve().parent
NODE_GO_DIR = HERE / "node" / "go"
KUBELET = BIN_DIR / "kubelet"
KUBELET_STAMP = BIN_DIR / "kubelet-stamp.json"
KUBELET_PACKAGE = "k8s.io/kubernetes/cmd/kubelet"
#: bump when the way the kubelet or the pause image is built changes
RECIPE = "1"
PAUSE_REPOSITORY = "localhost/wakegate/pause"
#: the `kubernetes` Service's ClusterIP (the first of e2e/cluster.py's SERVICE_CIDR)
KUBERNETES_SERVICE_IP = "10.96.0.1"
CNI_BIN = Path("/usr/lib/cni")
#: registries whose images the node pulls from the tests' registry instead (same repository paths)
STAND_IN_FOR = ("ghcr.io", "docker.io")

Log = Callable[[str], None]


def _log(msg: str) -> None:
    print(f"[e2e.node] {msg}", file=sys.stderr, flush=True)


# -- building -----------------------------------------------------------------------------------


def _kubelet_stamp() -> dict[str, str | None]:
    return {"go_mod_sum": go_mod_digest(NODE_GO_DIR), "go": go_version(), "recipe": RECIPE}


def ensure_kubelet(force: bool = False, log: Log = _log) -> Path:
    """The kubelet of the control plane's Kubernetes release (~12 min cold, a relink when warm)."""
    if not force and KUBELET.exists() and stamp_matches(KUBELET_STAMP, _kubelet_stamp()):
        return KUBELET
    if shutil.which("go") is None:
        raise BuildError("`go` is not on PATH; the real node's kubelet is built from its Go module")
    pin = pinned_version("k8s.io/kubernetes")
    if required_version(NODE_GO_DIR / "go.mod", "k8s.io/kubernetes") != pin:
        raise BuildError(f"{NODE_GO_DIR}/go.mod must require k8s.io/kubernetes {pin}, as e2e/go does")
    started = time.monotonic()
    log(f"go build kubelet {pin} (first build takes minutes)")
    staging = Path(tempfile.mkdtemp(prefix="kubelet-", dir=BIN_DIR))
    try:
        go_build([KUBELET_PACKAGE], staging / "kubelet", NODE_GO_DIR, _ldflags(), log)
        os.replace(staging / "kubelet", KUBELET)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    KUBELET_STAMP.write_text(json.dumps(_kubelet_stamp(), indent=2) + "\n")
    log(f"kubelet built in {time.monotonic() - started:.0f}s")
    return KUBELET


def _kubernetes_source() -> Path:
    out = subprocess.run(["go", "mod", "download", "-json", "k8s.io/kubernetes"], cwd=NODE_GO_DIR,
                         capture_output=True, text=True, env=go_env())
    if out.returncode != 0:
        raise BuildError(out.stdout + out.stderr)
    return Path(json.loads(out.stdout)["Dir"])


def ensure_pause(log: Log = _log) -> tuple[str, Path]:
    """The sandbox image (its ref, and a docker-archive of it for `ctr import`), built once."""
    source = _kubernetes_source() / "build" / "pause" / "linux" / "pause.c"
    gcc = subprocess.run(["gcc", "--version"], capture_output=True, check=True).stdout
    key = hashlib.sha256(source.read_bytes() + RECIPE.encode() + gcc).hexdigest()[:16]
    ref = f"{PAUSE_REPOSITORY}:{key}"
    archive = image.WORK / f"pause-{key}.tar"
    if archive.exists():
        return ref, archive
    log(f"building the pause image from {source.name} (gcc -static)")
    # `python -m e2e.node build` (e2e/ci.sh runs it when the real node is on) comes before the
    # project's image on a fresh clone and machine: neither podman nor the image work folder may
    # be there yet (as in ensure_llama_image).
    image.install_packages()
    image.WORK.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=image.WORK) as tmp:
        subprocess.run(["gcc", "-static", "-O2", f"-DVERSION={pinned_version('k8s.io/kubernetes')}",
                        "-o", f"{tmp}/pause", str(source)], check=True)
        Path(tmp, "Dockerfile").write_text('FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n')
        image.podman("build", "--network=host", "--tag", ref, tmp)
        image.podman("save", "--format", "docker-archive", "--output", f"{tmp}/pause.tar", ref)
        os.replace(f"{tmp}/pause.tar", archive)
    return ref, archive


# -- a running node ------------------------------------------------------------------------------


def _containerd_config(root: Path, state: Path, pause: str, cni_conf: Path, mirrors: dict[str, str]) -> str:
    # Images keep their names (127.0.0.1:PORT/..., ghcr.io/..., docker.io/...); containerd fetches
    # them over plain HTTP from the mirror each name maps to.
    mirror_toml = "".join(f'  [plugins."io.containerd.grpc.v1.cri".registry.mirrors."{name}"]\n'
                          f'    endpoint = ["http://{endpoint}"]\n' for name, endpoint in mirrors.items())
    return f"""\
version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "{state}/containerd.sock"
[ttrpc]
  address = "{state}/containerd.sock.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  # The CRI asks for oom_score_adj -998 for sandboxes; lowering it needs CAP_SYS_RESOURCE, which
  # this machine does not grant (runc's init then dies: "can't get final child's PID from pipe").
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{cni_conf}"
  [plugins."io.containerd.grpc.v1.cri".registry]
{mirror_toml}"""


class RealNode:
    """One kubelet + containerd node joined to `cluster`; `start()`, then `stop()` removes it all."""

    def __init__(self, cluster: Cluster, registry: str | None = None, name: str = "e2e-real-0",
                 log: Log = _log) -> None:
        assert cluster.network is not None and cluster.pod_cidr is not None, "start the cluster first"
        self.cluster = cluster
        self.registry = registry
        self.name = name
        self.log = log
        self.id = cluster.network.id
        self.netns = f"wgr{self.id}"
        self.host_iface = f"wgr{self.id}h"
        # The node's pod range is the last but one /24 of the cluster's (the emulated nodes count up
        # from the first); the veth pair's two addresses are in the last one, outside the pods'
        # on-link range (a pod would look for an address of its own /24 on the bridge).
        *_, cidr, link = ipaddress.IPv4Network(cluster.pod_cidr).subnets(new_prefix=24)
        self.cidr: ipaddress.IPv4Network = cidr
        self.host_ip, self.ns_ip = str(link[1]), str(link[2])
        self.bridge_ip = str(self.cidr[1])
        self.dir = cluster.dir / "real-node"
        #: sockets and runtime state: short paths (a unix socket path has 108 bytes at most)
        self.state = Path(f"/run/wgr{self.id}")
        self.cgroup_root = f"wakegate-e2e-{self.id}"
        self.procs: list[Proc] = []
        self._relay_loop: asyncio.AbstractEventLoop | None = None
        self._relay_thread = threading.Thread()
        self._relays: list[asyncio.Server] = []

    @property
    def socket(self) -> Path:
        return self.state / "containerd" / "containerd.sock"

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ctr", "--address", str(self.socket), "--namespace", "k8s.io", *args],
                              capture_output=True, text=True, check=check)

    def start(self, timeout: float = 120.0) -> None:
        image.install_packages((*image.APT_PACKAGES, *image.NODE_APT_PACKAGES))
        kubelet = ensure_kubelet(log=self.log)
        pause, pause_archive = ensure_pause(self.log)
        started = time.monotonic()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.state.mkdir(parents=True, exist_ok=True)
        try:
            self._network()
            _make_cgroups(self.cgroup_root)
            api = self._relay(int(self.cluster.server.rsplit(":", 1)[1]))
            # Pods reach the apiserver at the `kubernetes` Service IP, as in-cluster clients do.
            self._in_netns(["iptables", "-t", "nat", "-A", "PREROUTING", "-d", KUBERNETES_SERVICE_IP, "-p", "tcp",
                            "--dport", "443", "-j", "DNAT", "--to-destination", f"{self.host_ip}:{api}"])
            mirrors: dict[str, str] = {}
            if self.registry:
                # The tests' registry, reached through a relay, also stands in for ghcr.io and docker.io
                # (the chart's default images), which cannot be reached from here.
                relay = f"{self.host_ip}:{self._relay(int(self.registry.rsplit(':', 1)[1]))}"
                mirrors = dict.fromkeys((self.registry, *STAND_IN_FOR), relay)
            self._containerd(pause, pause_archive, mirrors)
            saved = _read_sysctls()
            self._kubelet(kubelet)
            self._wait_ready(started + timeout)
            # The kubelet sets kernel tunables it wants (panic on oops, reboot 10 s after a panic,
            # always overcommit) once, at start, unless protectKernelDefaults makes that fatal; this is
            # a shared machine: they are put back as soon as it is Ready.
            _write_sysctls(saved)
        except BaseException:
            self.stop()
            raise
        self.log(f"real node {self.name} Ready in {time.monotonic() - started:.1f}s ({self.cidr})")

    # -- pieces --

    def _network(self) -> None:
        ip = net.ip
        ip("netns", "add", self.netns)
        ip("link", "add", self.host_iface, "type", "veth", "peer", "name", "eth0", "netns", self.netns)
        ip("addr", "add", self.host_ip, "peer", self.ns_ip, "dev", self.host_iface)
        ip("link", "set", self.host_iface, "up")
        ip("-n", self.netns, "addr", "add", self.ns_ip, "peer", self.host_ip, "dev", "eth0")
        for link in ("eth0", "lo"):
            ip("-n", self.netns, "link", "set", link, "up")
        ip("-n", self.netns, "route", "add", "default", "via", self.host_ip, "dev", "eth0")
        ip("route", "add", str(self.cidr), "via", self.ns_ip, "dev", self.host_iface)
        self._in_netns(["sysctl", "-qw", "net.ipv4.ip_forward=1"])
        conf = self.dir / "cni"
        conf.mkdir(exist_ok=True)
        (conf / "10-wakegate.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "wakegate-e2e", "plugins": [{
                "type": "bridge", "bridge": "wgcni0", "isGateway": True, "ipMasq": False, "hairpinMode": True,
                "ipam": {"type": "host-local", "dataDir": str(self.state / "ipam"), "routes": [{"dst": "0.0.0.0/0"}],
                         "ranges": [[{"subnet": str(self.cidr), "gateway": self.bridge_ip,
                                      "rangeStart": str(self.cidr[10]), "rangeEnd": str(self.cidr[250])}]]},
            }, {"type": "portmap", "capabilities": {"portMappings": True}}],
        }))

    def _in_netns(self, argv: list[str]) -> None:
        subprocess.run(["ip", "netns", "exec", self.netns, *argv], check=True, capture_output=True)

    def _containerd(self, pause: str, pause_archive: Path, mirrors: dict[str, str]) -> None:
        config = self.dir / "containerd.toml"
        config.write_text(_containerd_config(self.dir / "containerd", self.state / "containerd", pause,
                                             self.dir / "cni", mirrors))
        # nsenter switches only the network namespace: mounts (overlays, the kubelet's volumes) stay shared.
        proc = Proc("containerd", ["nsenter", f"--net=/run/netns/{self.netns}", "containerd", "--config", str(config)],
                    self.cluster.dir / "logs" / "containerd.log", tie_to_parent=not self.cluster.keep)
        proc.start()
        self.procs.append(proc)
        deadline = time.monotonic() + 30
        while self.ctr("version", check=False).returncode != 0:
            if proc.exited() is not None or time.monotonic() > deadline:
                raise BuildError(f"containerd did not start:\n{proc.tail()}")
            time.sleep(0.2)
        self.ctr("images", "import", str(pause_archive))

    def _relay(self, port: int) -> int:
        """A byte relay from host_ip:PORT (returned) to 127.0.0.1:`port` here, where the apiserver and
        the tests' registry listen: the node's namespace (containerd, pods) reaches them that way."""
        if self._relay_loop is None:
            loop = asyncio.new_event_loop()
            self._relay_thread = threading.Thread(target=_serve_forever, args=(loop,), name="node-relays", daemon=True)
            self._relay_thread.start()
            self._relay_loop = loop
        sock = net.listen(self.host_ip, 0)
        server = asyncio.run_coroutine_threadsafe(net.relay_from(sock, "127.0.0.1", port), self._relay_loop).result(10)
        self._relays.append(server)
        return int(sock.getsockname()[1])

    def _kubelet(self, kubelet: Path) -> None:
        pki = PKI.load(self.cluster.pki_dir)
        pair = pki.issue(f"kubelet-{self.name}", f"system:node:{self.name}", org="system:nodes")
        kubeconfig = pki.kubeconfig(self.dir / "kubelet.kubeconfig", self.cluster.server, pair,
                                    f"system:node:{self.name}")

        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                               "x509": {"clientCAFile": str(pki.ca.cert)}},
            "authorization": {"mode": "AlwaysAllow"},
            "address": self.host_ip, "port": free_port(self.host_ip), "readOnlyPort": 0, "healthzPort": 0,
            # Hybrid cgroup v1 here; the cgroupfs driver, as runc is told (SystemdCgroup = false).
            "cgroupDriver": "cgroupfs", "failCgroupV1": False, "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "podCIDR": str(self.cidr), "resolvConf": "/etc/resolv.conf", "maxPods": 40,
            # A shared test machine: no image GC, evictions only when it is truly full.
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "enforceNodeAllocatable": [], "serializeImagePulls": False, "syncFrequency": "5s",
            "nodeStatusReportFrequency": "10s", "staticPodPath": "",
            "volumePluginDir": str(self.dir / "volume-plugins"),
            # A cgroup tree of its own: a kubelet kills what runs in pod cgroups it does not know
            # (orphans), so two real nodes on one machine must not share /kubepods.
            "cgroupRoot": f"/{self.cgroup_root}",
            # The kubelet would add KUBE-FIREWALL (dropping packets to 127.0.0.0/8 from other
            # sources) and canary chains to this machine's own iptables, and nothing removes them
            # when it stops: the node's network stays in its namespace, this machine's untouched.
            "makeIPTablesUtilChains": False,
        }
        config_file = self.dir / "kubelet.yaml"
        config_file.write_text(json.dumps(config))
        proc = Proc("kubelet", [str(kubelet), "--config", str(config_file), "--kubeconfig", str(kubeconfig),
                                "--root-dir", str(self.dir / "kubelet"), "--cert-dir", str(self.dir / "kubelet-pki"),
                                "--hostname-override", self.name, "--node-ip", self.host_ip, "--v=1"],
                    self.cluster.dir / "logs" / "kubelet.log", tie_to_parent=not self.cluster.keep)
        proc.start()
        self.procs.append(proc)

    def _wait_ready(self, deadline: float) -> None:
        from kubernetes import client

        with self.cluster.api_client() as api:
            core = client.CoreV1Api(api)
            while True:
                ready = False
                try:
                    node = core.read_node(self.name)
                    ready = any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])
                except client.ApiException as exc:
                    if exc.status != 404:
                        raise
                if ready:
                    return
                for proc in self.procs:
                    if proc.exited() is not None:
                        raise BuildError(f"{proc.name} exited {proc.exited()}:\n{proc.tail()}")
                if time.monotonic() > deadline:
                    raise BuildError(f"node {self.name} not Ready in time; kubelet log:\n{self.procs[-1].tail()}")
                time.sleep(0.5)

    # -- teardown --

    def stop(self) -> None:
        """Stop the kubelet, every pod's processes and containerd; remove mounts, namespaces, routes, files."""
        kubelets = [p for p in self.procs if p.name == "kubelet"]
        stop_all(kubelets, 5.0)
        sandbox_netns = self._kill_tasks()
        stop_all([p for p in self.procs if p.name != "kubelet"], 5.0)
        self.procs = []
        self._kill_shims()
        for path in (self.dir, self.state):
            _unmount_under(path)
        _remove_cgroups(self.cgroup_root)
        for ns in sandbox_netns:
            subprocess.run(["umount", ns], capture_output=True)
            Path(ns).unlink(missing_ok=True)
        if self._relay_loop is not None:
            for server in self._relays:
                self._relay_loop.call_soon_threadsafe(server.close)
            self._relays = []
            self._relay_loop.call_soon_threadsafe(self._relay_loop.stop)
            self._relay_thread.join(10)
            self._relay_loop = None
        net.ip("route", "del", str(self.cidr), check=False)
        net.ip("link", "del", self.host_iface, check=False)
        net.ip("netns", "del", self.netns, check=False)
        shutil.rmtree(self.state, ignore_errors=True)
        shutil.rmtree(self.dir / "containerd", ignore_errors=True)
        shutil.rmtree(self.dir / "kubelet", ignore_errors=True)

    def _kill_tasks(self) -> list[str]:
        """SIGKILL every container's task; returns the pod network namespaces (files) to remove."""
        if not self.socket.exists() or self.ctr("version", check=False).returncode != 0:
            return []
        namespaces: set[str] = set()
        for cid in self.ctr("containers", "ls", "--quiet", check=False).stdout.split():
            info = self.ctr("containers", "info", cid, check=False)
            try:
                spec: dict[str, Any] = json.loads(info.stdout).get("Spec") or {}
            except ValueError:
                spec = {}
            for ns in spec.get("linux", {}).get("namespaces", []):
                if ns.get("type") == "network" and ns.get("path"):
                    namespaces.add(ns["path"])
            self.ctr("tasks", "kill", "--signal", "SIGKILL", cid, check=False)
        return sorted(namespaces)

    def _kill_shims(self) -> None:
        """containerd's shims start sessions of their own: found by the socket they were given."""
        mark = str(self.state).encode()
        for pid, argv in _command_lines():
            if argv.startswith(b"/usr/bin/containerd-shim") and mark in argv:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _command_lines() -> Iterator[tuple[int, bytes]]:
    """(pid, NUL-separated argv) of every process still readable."""
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            yield int(entry.name), (entry / "cmdline").read_bytes()


def _serve_forever(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    loop.run_forever()
    for task in asyncio.all_tasks(loop):
        task.cancel()
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()


#: what the kubelet sets at start (pkg/kubelet/cm setupKernelTunables) and the node puts back
KUBELET_SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
                   "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")


def _read_sysctls() -> dict[str, str]:
    return {name: Path("/proc/sys", name).read_text() for name in KUBELET_SYSCTLS}


def _write_sysctls(values: dict[str, str]) -> None:
    for name, value in values.items():
        if Path("/proc/sys", name).read_text() != value:
            Path("/proc/sys", name).write_text(value)


CGROUP_V1 = Path("/sys/fs/cgroup")


def _hierarchies(unified: bool = False) -> list[Path]:
    """The cgroup hierarchies: the v1 ones, and with `unified` the v2 one beside them (hybrid: it
    has no controllers, but the kubelet makes its tree there too)."""
    return [d for d in sorted(CGROUP_V1.iterdir())
            if (d / "cgroup.procs").exists() and (unified or d.name != "unified")]


def _make_cgroups(name: str) -> None:
    for hierarchy in _hierarchies():
        (hierarchy / name).mkdir(exist_ok=True)
        if hierarchy.name == "cpuset":
            # A new cpuset starts empty (no CPU, no memory node): nothing could run in it.
            for knob in ("cpuset.cpus", "cpuset.mems"):
                (hierarchy / name / knob).write_text((hierarchy / knob).read_text())


def _remove_cgroups(name: str) -> None:
    """rmdir the node's cgroup trees, deepest first (a cgroup goes once its processes have)."""
    for hierarchy in _hierarchies(unified=True):
        root = hierarchy / name
        if not root.is_dir():
            continue
        for dirpath, _, _ in sorted(os.walk(root), key=lambda entry: -len(entry[0])):
            for _ in range(20):
                try:
                    os.rmdir(dirpath)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)


def _unmount_under(path: Path) -> None:
    prefix = str(path).rstrip("/") + "/"
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    for point in sorted((m for m in mounts if m.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "--lazy", point], capture_output=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.node", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="build (or reuse) the kubelet and the pause image")
    up = sub.add_parser("up", help="join a real node to the cluster running in --cluster-dir until Ctrl-C")
    up.add_argument("--cluster-dir", type=Path, required=True)
    up.add_argument("--registry", help="HOST:PORT of a plain-HTTP registry containerd pulls from")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "build":
            print(f"kubelet: {ensure_kubelet()}")
            print(f"pause: {ensure_pause()[0]}")
            return 0
        from e2e.cluster import Cluster

        node = RealNode(Cluster.attach(args.cluster_dir.resolve()), registry=args.registry)
        node.start()
    except BuildError as exc:
        _log(str(exc))
        return 1
    print(f"ready {node.name}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
