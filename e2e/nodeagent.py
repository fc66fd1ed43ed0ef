"""The e2e node agent: a kubelet stand-in whose pods are local processes.

    python -m e2e.nodeagent --kubeconfig KUBECONFIG --network NET.json [--nodes 2] [--work-dir DIR]

Registers fake GPU nodes, keeps their leases fresh, and runs every pod the
scheduler binds to them: an IP from its node's range, added to the node's
network namespace (made by the cluster, see e2e/net.py), one process per
container inside that namespace (e2e/images.py), real probes, restart backoff,
graceful termination. Test infrastructure only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import signal
import sys
import urllib.parse
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import aiohttp

from e2e import net
from e2e.containers import Settings
from e2e.kubeapi import ApiError, KubeAPI, WatchExpired
from e2e.nodes import NodeKeeper, NodeSpec, default_nodes, load_nodes
from e2e.pods import PodWorker

log = logging.getLogger("e2e.nodeagent")

#: when the agent itself stops, pods get at most this long to exit
SHUTDOWN_GRACE_SECONDS = 2.0


class IPPool:
    """Pod IPs from a node's range, handed out in order and reused only when free."""

    def __init__(self, cidr: str, reserved: Iterable[str] = ()) -> None:
        network = ipaddress.ip_network(cidr)
        skip = set(reserved)
        self._hosts = [str(ip) for ip in network.hosts() if str(ip) not in skip]
        self._next = 0
        self._used: set[str] = set()

    def take(self) -> str:
        for _ in range(len(self._hosts)):
            ip = self._hosts[self._next]
            self._next = (self._next + 1) % len(self._hosts)
            if ip not in self._used:
                self._used.add(ip)
                return ip
        raise RuntimeError("pod IP range exhausted")

    def give_back(self, ip: str) -> None:
        self._used.discard(ip)


class Agent:
    def __init__(
        self,
        api: KubeAPI,
        nodes: list[NodeSpec],
        work_dir: Path,
        network: net.ClusterNet,
        settings: Settings,
        relay_ports: Iterable[int] = (),
    ) -> None:
        if len(network.nodes) < len(nodes):
            raise ValueError(f"the network has {len(network.nodes)} node namespaces for {len(nodes)} nodes")
        self.api = api
        self.nodes = {n.name: n for n in nodes}
        self.keeper = NodeKeeper(api, nodes)
        self.work_dir = work_dir
        #: node i runs its pods in the i-th namespace of the cluster network
        self.node_nets = {spec.name: network.nodes[i] for i, spec in enumerate(nodes)}
        self.pools = {name: IPPool(n.cidr, n.reserved()) for name, n in self.node_nets.items()}
        self.relay_ports = sorted(set(relay_ports))
        self.settings = settings
        self.workers: dict[str, PodWorker] = {}
        self._http: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._relays: list[asyncio.Server] = []

    async def run(self, stop: asyncio.Event) -> None:
        # A fresh connection per probe, as the kubelet's probes disable keep-alive.
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        try:
            # Pods reach the apiserver (and any other relayed port) at 127.0.0.1 in their namespace.
            for node in self.node_nets.values():
                for port in self.relay_ports:
                    self._relays.append(await net.relay(node.netns, port))
            await self.keeper.register()
            heartbeat = asyncio.create_task(self.keeper.run())
            pods = asyncio.create_task(self._pods())
            await stop.wait()
            heartbeat.cancel()
            pods.cancel()
            for task in (heartbeat, pods):
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await asyncio.gather(*(w.stop(SHUTDOWN_GRACE_SECONDS) for w in self.workers.values()))
            await asyncio.gather(*(w.kill() for w in self.workers.values()))
        finally:
            for server in self._relays:
                server.close()
            await self._http.close()

    # -- pod watch -------------------------------------------------------------

    def _mine(self, pod: dict[str, Any]) -> bool:
        return pod["spec"].get("nodeName") in self.nodes

    async def _pods(self) -> None:
        while True:
            try:
                listing = await self.api.get("/api/v1/pods")
                seen = set()
                for pod in listing["items"]:
                    if self._mine(pod):
                        seen.add(pod["metadata"]["uid"])
                        await self._handle("MODIFIED", pod)
                for uid in set(self.workers) - seen:
                    await self._gone(uid)
                version = listing["metadata"]["resourceVersion"]
                while True:
                    async for kind, obj in self.api.watch("/api/v1/pods", version):
                        version = obj["metadata"].get("resourceVersion", version)
                        if kind != "BOOKMARK" and self._mine(obj):
                            await self._handle(kind, obj)
            except WatchExpired:
                continue
            except (ApiError, aiohttp.ClientError, OSError, TimeoutError) as exc:
                log.warning("pod watch failed (%s); relisting", exc)
                await asyncio.sleep(1)

    async def _handle(self, kind: str, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        worker = self.workers.get(uid)
        if kind == "DELETED":
            await self._gone(uid)
            return
        if worker is not None:
            worker.update(pod)
            return
        phase = (pod.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            return  # finished before this agent started; nothing to run
        if pod["metadata"].get("deletionTimestamp"):
            # Never started here: nothing to stop, so finish the deletion at once.
            with contextlib.suppress(ApiError):
                await self.api.delete(
                    f"/api/v1/namespaces/{pod['metadata']['namespace']}/pods/{pod['metadata']['name']}",
                    {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}},
                )
            return
        assert self._http is not None
        node_name = pod["spec"]["nodeName"]
        if pod["spec"].get("hostNetwork"):
            ip, netns = "127.0.0.1", None
        else:
            node = self.node_nets[node_name]
            ip, netns = self.pools[node_name].take(), node.netns
            try:
                await net.add_pod_ip(node, ip)
            except net.NetError as exc:
                # Left Pending: the next event for this pod tries again.
                self.pools[node_name].give_back(ip)
                log.error("pod %s/%s: cannot add its IP: %s",
                          pod["metadata"]["namespace"], pod["metadata"]["name"], exc)
                return
        log.info("starting pod %s/%s on %s with IP %s",
                 pod["metadata"]["namespace"], pod["metadata"]["name"], node_name, ip)
        self.workers[uid] = PodWorker(pod, ip, self.api, self._http, self.work_dir, self.settings, netns=netns)

    async def _gone(self, uid: str) -> None:
        worker = self.workers.pop(uid, None)
        if worker is None:
            return
        log.info("pod %s/%s gone", worker.namespace, worker.name)
        # Not awaited inline: a slow kill must not hold up the watch.
        task = asyncio.create_task(self._reap(worker))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reap(self, worker: PodWorker) -> None:
        await worker.kill()
        if worker.netns is None:
            return  # hostNetwork: 127.0.0.1, nothing to give back
        node_name = worker.pod["spec"]["nodeName"]
        try:
            await net.del_pod_ip(self.node_nets[node_name], worker.ip)
        except net.NetError as exc:
            log.warning("pod %s/%s: cannot remove its IP: %s", worker.namespace, worker.name, exc)
            return  # still on the interface: not handed out again
        self.pools[node_name].give_back(worker.ip)


async def amain(args: argparse.Namespace) -> int:
    spec_file = Path(args.node_spec) if args.node_spec else None
    nodes = load_nodes(spec_file) if spec_file else default_nodes(args.nodes, args.name_prefix)
    settings = Settings(backoff_initial=args.backoff_initial, backoff_max=args.backoff_max)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    network = net.ClusterNet.load(Path(args.network))
    missing = [n.netns for n in network.nodes if not (net.NETNS_DIR / n.netns).exists()]
    if missing:
        log.error("network namespaces %s do not exist (the cluster makes them, see e2e/net.py)", missing)
        return 2
    work_dir = Path(args.work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    async with KubeAPI(Path(args.kubeconfig)) as api:
        server = urllib.parse.urlsplit(api.config.server)
        relay_ports = list(args.relay_port)
        if server.hostname == "127.0.0.1" and server.port:
            relay_ports.append(server.port)
        await Agent(api, nodes, work_dir, network, settings, relay_ports).run(stop)
    log.info("node agent stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.nodeagent", description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--nodes", type=int, default=2, help="how many default GPU nodes (default 2)")
    parser.add_argument("--node-spec", help="YAML list of {name, labels, capacity, taints}")
    parser.add_argument("--name-prefix", default="e2e-node", help="node names: PREFIX-0, ...")
    parser.add_argument("--work-dir", default="e2e-agent", help="pod logs and per-pod files")
    parser.add_argument("--network", required=True,
                        help="the cluster's pod network (JSON written by e2e.cluster, see e2e/net.py)")
    parser.add_argument("--relay-port", type=int, action="append", default=[],
                        help="also relay this 127.0.0.1 port into every node namespace (the apiserver's is)")
    parser.add_argument("--backoff-initial", type=float, default=10.0, help="first crash-loop backoff (s)")
    parser.add_argument("--backoff-max", type=float, default=300.0, help="longest crash-loop backoff (s)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
