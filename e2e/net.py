"""Pod networking: one network namespace per fake node, pod IPs routed from the root namespace.

Why: the apiserver rejects loopback addresses in EndpointSlices ("may not be in
the loopback range"), so pods need non-loopback IPs; and test traffic may only
go to loopback or to addresses inside network namespaces the harness made
itself. So each cluster gets a private 10.X.0.0/16 (X picked so it overlaps no
route or address on this machine) that exists only inside its namespaces:

    root namespace                                  netns wg<id>-<i> (node i)
    unreachable 10.X.0.0/16                         lo up (127.0.0.1: apiserver relay)
    veth wg<id>-<i>  10.X.i.1 peer 10.X.i.2  <---->  eth0  10.X.i.2 peer 10.X.i.1 (node address)
    10.X.i.0/24 via 10.X.i.2                              10.X.i.3... /32 (one per pod)
                                                    10.X.0.0/16 via 10.X.i.1 src 10.X.i.2
                                                    unreachable 10.X.i.0/24

The root namespace (control plane, node agent, Envoy, tests) reaches pod IPs
through the veth; pods reach other nodes' pods through the root namespace
(forwarding is enabled on our veths only, and pods have no default route, so
nothing leaves for other networks); an address of a deleted pod answers
"host unreachable" at once. Pods reach the apiserver at its usual
https://127.0.0.1:PORT through a relay the node agent runs inside each namespace.

Everything a cluster creates is recorded in STATE_DIR/<id>.json (written before
anything is created) with the processes that own it; a later `create` removes
what dead owners left behind. Needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import ipaddress
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
Log = Callable[[str], None]

NETNS_DIR = Path("/run/netns")
#: one JSON file per live cluster network, plus the lock that serialises creation
STATE_DIR = Path(os.environ.get("WAKEGATE_E2E_NET_DIR", "/run/wakegate-e2e"))
#: interface of a node namespace that holds its node address and its pods' IPs
POD_IFACE = "eth0"
#: second octets a cluster's 10.X.0.0/16 is picked from (10.96.0.0/16 is the Service range)
SECOND_OCTETS = range(100, 251)
#: `wg` + 6 hex digits of cluster id + `-` + node index: a namespace and its root-side veth
_NAME = re.compile(r"^wg([0-9a-f]{6})-(\d{1,3})$")
_CLONE_NEWNET = 0x40000000
_LOOPBACK = ipaddress.ip_network("127.0.0.0/8")


class NetError(RuntimeError):
    """Setting up the pod network failed; the message names the command."""


@dataclass(frozen=True)
class NodeNet:
    """One fake node's namespace and addresses."""

    netns: str  # the namespace, and the name of its root-side veth
    cidr: str  # the node's pod range, 10.X.i.0/24
    gateway: str  # 10.X.i.1, root side of the veth
    address: str  # 10.X.i.2, the namespace side (eth0)
    iface: str = POD_IFACE

    def reserved(self) -> tuple[str, ...]:
        """Addresses of the range that are not pod IPs."""
        return (self.gateway, self.address)


@dataclass
class ClusterNet:
    """A cluster's pod network: its 10.X.0.0/16 and one NodeNet per node."""

    id: str
    cidr: str
    nodes: list[NodeNet] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ClusterNet:
        return cls(id=raw["id"], cidr=raw["cidr"], nodes=[NodeNet(**n) for n in raw["nodes"]])

    @classmethod
    def load(cls, path: Path) -> ClusterNet:
        return cls.from_dict(json.loads(path.read_text()))

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @property
    def registry(self) -> Path:
        return STATE_DIR / f"{self.id}.json"


def plan(cluster_id: str, cidr: str, nodes: int) -> ClusterNet:
    """Names and addresses for `nodes` nodes: node i gets the i-th /24 of `cidr`."""
    network = ipaddress.ip_network(cidr)
    if not isinstance(network, ipaddress.IPv4Network) or network.prefixlen > 24:
        raise NetError(f"pod CIDR {cidr} must be an IPv4 range of /24 or larger")
    if network.overlaps(_LOOPBACK):
        raise NetError(f"pod CIDR {cidr} is loopback, which the apiserver refuses in EndpointSlices")
    if nodes > min(2 ** (24 - network.prefixlen), 1000):
        raise NetError(f"pod CIDR {cidr} has too few /24s for {nodes} nodes")
    result = ClusterNet(id=cluster_id, cidr=str(network))
    for i, sub in zip(range(nodes), network.subnets(new_prefix=24), strict=False):
        hosts = sub.hosts()
        result.nodes.append(NodeNet(
            netns=f"wg{cluster_id}-{i}", cidr=str(sub), gateway=str(next(hosts)), address=str(next(hosts)),
        ))
    return result


# -- running ip ----------------------------------------------------------------


def _need_ip() -> None:
    if shutil.which("ip") is None:
        raise NetError("the `ip` command (iproute2) is missing; install it: apt-get install -y iproute2")


def ip(*args: str, check: bool = True) -> str:
    """Run `ip ARGS`; NetError naming the command if it fails (and `check`)."""
    cmd = ["ip", *args]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetError(f"`{' '.join(cmd)}` could not run: {exc}") from exc
    if out.returncode != 0 and check:
        raise NetError(
            f"`{' '.join(cmd)}` failed ({out.stderr.strip() or out.returncode}); the e2e harness creates "
            "network namespaces and veths for its nodes and needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"
        )
    return out.stdout


async def aip(*args: str, ok_errors: Sequence[str] = ()) -> None:
    """`ip ARGS` from asyncio; an error whose message contains one of `ok_errors` counts as success."""
    proc = await asyncio.create_subprocess_exec(
        "ip", *args, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await proc.communicate()
    message = err.decode(errors="replace").strip()
    if proc.returncode != 0 and not any(e in message for e in ok_errors):
        raise NetError(f"`ip {' '.join(args)}` failed: {message or proc.returncode}")


# -- namespaces from Python ------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)


def _setns(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


_CLONE_NEWNS = 0x00020000
_MS_RDONLY, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18


def _mount(source: str | None, target: str, flags: int) -> None:
    src = source.encode() if source is not None else b"none"
    if _libc.mount(src, target.encode(), None, flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount({source}, {target}): {os.strerror(err)}")


def bind_mounts(mounts: list[tuple[str, str, bool]]) -> None:
    """In the calling process: a mount namespace of its own, with each (host path, path, read
    only) bound there, as a container runtime mounts a pod's hostPath volumes. Nothing changes
    for the host: the namespace's mounts are private (the paths must exist)."""
    if _libc.unshare(_CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNS): {os.strerror(err)}")
    _mount(None, "/", _MS_REC | _MS_PRIVATE)
    for host, path, read_only in mounts:
        _mount(host, path, _MS_BIND | _MS_REC)
        if read_only:
            _mount(None, path, _MS_BIND | _MS_REMOUNT | _MS_RDONLY)


def netns_preexec(name: str) -> Callable[[], None]:
    """A preexec_fn that moves the child into namespace `name` (the child keeps its PID)."""
    path = NETNS_DIR / name

    def preexec() -> None:
        _setns(path)

    return preexec


def in_netns(name: str, fn: Callable[[], T]) -> T:
    """Run `fn` in a short-lived thread that joined namespace `name` (setns is per thread).

    Sockets keep the namespace they were created in, so this is how the agent
    opens listening sockets inside a node's namespace.
    """
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            _setns(NETNS_DIR / name)
            result.append(fn())
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=run, name=f"netns-{name}", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def _write_sysctl(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


# -- what is there ----------------------------------------------------------------


def netns_names() -> list[str]:
    # `ip netns list` prints "NAME" or "NAME (id: N)"
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def link_names() -> list[str]:
    return [link["ifname"] for link in json.loads(ip("-j", "link", "show") or "[]")]


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 route destination (all tables) and address on this machine's root namespace."""
    used = []
    for route in json.loads(ip("-4", "-j", "route", "show", "table", "all") or "[]"):
        dst = route.get("dst", "")
        if dst and dst != "default":
            with contextlib.suppress(ValueError):
                used.append(ipaddress.IPv4Network(dst, strict=False))
    for link in json.loads(ip("-4", "-j", "addr", "show") or "[]"):
        for addr in link.get("addr_info", []):
            with contextlib.suppress(ValueError, KeyError):
                used.append(ipaddress.IPv4Network(f"{addr['local']}/{addr['prefixlen']}", strict=False))
    return used


def _conflicts(cidr: str) -> list[str]:
    network = ipaddress.IPv4Network(cidr)
    found = [str(n) for n in _used_networks() if n.overlaps(network)]
    for state in _registries():
        if ipaddress.IPv4Network(state["net"]["cidr"]).overlaps(network):
            found.append(f"{state['net']['cidr']} (e2e cluster {state['net']['id']})")
    return found


def pick_cidr() -> str:
    """A 10.X.0.0/16 that overlaps no route, address or other e2e cluster here."""
    octets = list(SECOND_OCTETS)
    random.shuffle(octets)
    for x in octets:
        cidr = f"10.{x}.0.0/16"
        if not _conflicts(cidr):
            return cidr
    raise NetError(f"no free 10.X.0.0/16 for pod IPs (X in {SECOND_OCTETS.start}-{SECOND_OCTETS.stop - 1})")


# -- ownership ---------------------------------------------------------------------


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), to tell a reused PID apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces; fields after its ")" are plain.
    return stat.rsplit(")", 1)[1].split()[19]


def _owner(pid: int) -> dict[str, Any]:
    return {"pid": pid, "start": _start_time(pid)}


def _alive(owner: dict[str, Any]) -> bool:
    return owner.get("start") is not None and _start_time(int(owner["pid"])) == owner["start"]


def _registries() -> list[dict[str, Any]]:
    states = []
    for path in sorted(STATE_DIR.glob("*.json")):
        with contextlib.suppress(OSError, ValueError, KeyError):
            state = json.loads(path.read_text())
            if isinstance(state["net"]["id"], str):  # malformed files are skipped
                states.append(state)
    return states


def _write_registry(network: ClusterNet, owners: Sequence[int]) -> None:
    state = {"net": network.to_dict(), "owners": [_owner(pid) for pid in owners]}
    tmp = network.registry.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.replace(network.registry)


def set_owners(network: ClusterNet, pids: Sequence[int]) -> None:
    """The processes whose life keeps this network in use (the cluster's components)."""
    _write_registry(network, pids)


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with (STATE_DIR / "lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# -- create / destroy --------------------------------------------------------------


def create(nodes: int, cidr: str | None = None, owner: int | None = None, log: Log | None = None) -> ClusterNet:
    """Make the namespaces, veths and routes for a cluster of `nodes` nodes."""
    _need_ip()
    with _locked():
        reap_stale(log)
        taken = set(netns_names()) | set(link_names())
        while True:
            cluster_id = secrets.token_hex(3)
            if not any(name.startswith(f"wg{cluster_id}-") for name in taken):
                break
        if cidr is None:
            cidr = pick_cidr()
        else:
            conflicts = _conflicts(str(ipaddress.ip_network(cidr)))
            if conflicts:
                raise NetError(f"pod CIDR {cidr} overlaps {', '.join(conflicts)} on this machine")
        network = plan(cluster_id, cidr, nodes)
        # Recorded before anything exists, so a crash at any point leaves a record to clean up by.
        _write_registry(network, [os.getpid() if owner is None else owner])
        try:
            _setup(network, log)
        except BaseException:
            destroy(network)
            raise
    return network


def _forward_in(netns: str, iface: str) -> None:
    # /proc/sys/net shows the namespace of the thread that opens it.
    in_netns(netns, lambda: _write_sysctl(f"/proc/sys/net/ipv4/conf/{iface}/forwarding", "1"))


def _setup(network: ClusterNet, log: Log | None) -> None:
    ip("route", "add", "unreachable", network.cidr)
    for node in network.nodes:
        ns, host = node.netns, node.netns
        ip("netns", "add", ns)
        ip("link", "add", host, "type", "veth", "peer", "name", node.iface, "netns", ns)
        ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", ns, "addr", "add", node.address, "peer", node.gateway, "dev", node.iface)
        ip("-n", ns, "link", "set", node.iface, "up")
        ip("-n", ns, "route", "add", network.cidr, "via", node.gateway, "dev", node.iface, "src", node.address)
        # A deleted pod's address answers "host unreachable" at once (needs forwarding on eth0
        # for the ICMP) instead of a connect that hangs.
        ip("-n", ns, "route", "add", "unreachable", node.cidr)
        _forward_in(ns, node.iface)
        ip("addr", "add", node.gateway, "peer", node.address, "dev", host)
        ip("link", "set", host, "up")
        ip("route", "add", node.cidr, "via", node.address, "dev", host)
        try:
            # Pod-to-pod across nodes: forward what comes in on our veths (only those).
            _write_sysctl(f"/proc/sys/net/ipv4/conf/{host}/forwarding", "1")
        except OSError as exc:
            if log is not None:
                log(f"WARNING: cannot enable forwarding on {host} ({exc}): pods cannot reach other nodes' pods")


def destroy(network: ClusterNet) -> None:
    """Remove what `create` made (what is already gone is skipped), then its record."""
    me = os.getpid()
    for node in network.nodes:
        if (NETNS_DIR / node.netns).exists():
            # Pods of a killed agent: a namespace stays alive while a process is in it.
            for pid in ip("netns", "pids", node.netns, check=False).split():
                if pid.isdigit() and int(pid) != me:
                    with contextlib.suppress(OSError):
                        os.kill(int(pid), signal.SIGKILL)
        # Deleting the root-side veth deletes its peer and every route through it at once;
        # the namespace itself is freed asynchronously by the kernel.
        ip("link", "del", node.netns, check=False)
        ip("netns", "del", node.netns, check=False)
    ip("route", "del", "unreachable", network.cidr, check=False)
    network.registry.unlink(missing_ok=True)


def leftovers(network: ClusterNet) -> list[str]:
    """What of `network` still exists (empty after `destroy`): for tests and diagnostics."""
    names = {n.netns for n in network.nodes}
    found = [f"netns {n}" for n in netns_names() if n in names]
    found += [f"link {n}" for n in link_names() if n in names]
    cidr = ipaddress.IPv4Network(network.cidr)
    for route in json.loads(ip("-4", "-j", "route", "show", "table", "all") or "[]"):
        dst = route.get("dst", "")
        with contextlib.suppress(ValueError):
            if dst and dst != "default" and ipaddress.IPv4Network(dst, strict=False).overlaps(cidr):
                found.append(f"route {route.get('type', '')} {dst} {route.get('dev', '')}".strip())
    return found


def reap_stale(log: Log | None = None) -> list[str]:
    """Remove networks of e2e clusters whose owners are all dead; their ids.

    Also removes namespaces/veths named like ours (wg<6 hex>-<n>) that no record
    claims and no process uses: a record is written before anything is created,
    so those can only be half-deleted leftovers.
    """
    reaped = []
    claimed = set()
    for state in _registries():
        network = ClusterNet.from_dict(state["net"])
        if any(_alive(o) for o in state.get("owners", [])):
            claimed.add(network.id)
            continue
        if log is not None:
            log(f"removing the pod network of a dead e2e cluster: {network.id} ({network.cidr})")
        destroy(network)
        reaped.append(network.id)
    for name in netns_names():
        m = _NAME.match(name)
        if m and m.group(1) not in claimed and not ip("netns", "pids", name, check=False).split():
            ip("link", "del", name, check=False)
            ip("netns", "del", name, check=False)
    for name in link_names():
        m = _NAME.match(name.split("@")[0])
        if m and m.group(1) not in claimed:
            ip("link", "del", name.split("@")[0], check=False)
    return reaped


# -- the node agent's side ---------------------------------------------------------


async def add_pod_ip(node: NodeNet, addr: str) -> None:
    await aip("-n", node.netns, "addr", "add", f"{addr}/32", "dev", node.iface, ok_errors=("File exists",))


async def del_pod_ip(node: NodeNet, addr: str) -> None:
    await aip("-n", node.netns, "addr", "del", f"{addr}/32", "dev", node.iface,
              ok_errors=("Cannot assign requested address", "Cannot find device", "No such file"))


def listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):
        writer.close()


async def relay(netns: str, port: int) -> asyncio.Server:
    """Listen on 127.0.0.1:port inside `netns`; pass each connection to 127.0.0.1:port here.

    This is how pods reach the apiserver at the same https://127.0.0.1:PORT as
    everything else (a byte relay: TLS and client identities are untouched).
    """
    return await relay_from(in_netns(netns, lambda: listen("127.0.0.1", port)), "127.0.0.1", port)


async def relay_from(sock: socket.socket, host: str, port: int) -> asyncio.Server:
    """Serve the listening `sock`: each connection is passed, byte for byte, to host:port."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()

    return await asyncio.start_server(handle, sock=sock)
