"""`wakegate agent`: the GPU node agent (one per node, a DaemonSet).

Finds the node's accelerators through :mod:`wakegate.control.gpu` (NVML, amdsmi, or a fake file for
tests) and writes what the scheduler extender reads onto the Node:

- labels `wakegate.io/gpu.vendor`, `gpu.arch`, `gpu.count`, `gpu.vram-mb` (per GPU, MiB);
- annotations `wakegate.io/gpu-free-memory-mb` (summed over the GPUs) and
  `wakegate.io/gpu-utilization` (mean percent), refreshed every `--interval` seconds.

It patches only keys whose value changed (one merge patch, never the whole Node). No GPU, no
library or a library that fails: the wakegate labels are removed (if present), one log line
says why, and the agent keeps running, so a driver that appears later is picked up.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

from wakegate.control.agent.labels import node_report, patch_for
from wakegate.control.gpu import Discovery, DiscoveryError, GpuDevice, probe

log = logging.getLogger("wakegate.agent")


class NodeAgent:
    def __init__(self, core: Any, node: str, discoveries: list[Discovery], problems: list[str]) -> None:
        self.core = core
        self.node = node
        self.discoveries = discoveries
        self.problems = problems
        self.labels: dict[str, str] | None = None
        self.annotations: dict[str, str] = {}
        self._said = ""

    def _say(self, line: str) -> None:
        """Log a state line once, again only when it changes (not every interval)."""
        if line != self._said:
            log.info("%s", line)
            self._said = line

    def devices(self) -> tuple[list[GpuDevice], list[str]]:
        found: list[GpuDevice] = []
        problems = list(self.problems)
        for discovery in self.discoveries:
            try:
                found += discovery.devices()
            except DiscoveryError as exc:
                problems.append(f"{discovery.name}: {exc}")
        return found, problems

    def sync(self) -> bool:
        """One round; True when the Node was patched."""
        if self.labels is None:
            meta = self.core.read_node(self.node).metadata
            self.labels = dict(meta.labels or {})
            self.annotations = dict(meta.annotations or {})
        devices, problems = self.devices()
        report = node_report(devices)
        if devices:
            self._say(f"node {self.node}: {len(devices)} GPU(s), labels {report.labels}")
        else:
            why = "; ".join(problems) or "the GPU libraries found no device"
            self._say(f"node {self.node}: no GPU found ({why}); the node gets no wakegate GPU labels")
        patch = patch_for(report, self.labels, self.annotations)
        if patch is None:
            return False
        self.core.patch_node(self.node, patch)
        for key, value in patch["metadata"].get("labels", {}).items():
            self._set(self.labels, key, value)
        for key, value in patch["metadata"].get("annotations", {}).items():
            self._set(self.annotations, key, value)
        log.debug("patched node %s: %s", self.node, patch)
        return True

    @staticmethod
    def _set(target: dict[str, str], key: str, value: str | None) -> None:
        if value is None:
            target.pop(key, None)
        else:
            target[key] = value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--node-name", default=os.environ.get("NODE_NAME"),
      help="the Node to label (default: $NODE_NAME, set it from spec.nodeName in the DaemonSet)")
    a("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG, else in-cluster)")
    a("--interval", type=float, default=15.0, help="seconds between refreshes of the annotations (default 15)")
    a("--fake-gpus", type=Path, default=None, metavar="FILE",
      help="read GPUs from a JSON file instead of NVML/amdsmi (tests, demos; see control/gpu/fake.py)")
    a("--once", action="store_true", help="one round, then exit")
    a("--log-level", default="INFO", help="logging level (default INFO)")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if not args.node_name:
        log.error("no node name: pass --node-name or set NODE_NAME")
        return 2
    from kubernetes.client import CoreV1Api
    from kubernetes.client.exceptions import ApiException
    from kubernetes.config import ConfigException
    from urllib3.exceptions import HTTPError

    from wakegate.control.extender.kube import api_client
    from wakegate.control.gpu.fake import FakeDiscovery

    if args.fake_gpus is not None:
        discoveries: list[Discovery] = [FakeDiscovery(args.fake_gpus, args.node_name)]
        problems: list[str] = []
    else:
        discoveries, problems = probe()
    try:
        core = CoreV1Api(api_client(args.kubeconfig))
    except (ConfigException, OSError) as exc:
        log.error("no Kubernetes configuration: %s", exc)
        return 2
    agent = NodeAgent(core, args.node_name, discoveries, problems)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        while True:
            failed = False
            try:
                agent.sync()
            except (ApiException, HTTPError, OSError) as exc:
                # Re-read the Node next round: our view of it may be stale.
                agent.labels = None
                failed = True
                log.warning("updating node %s failed: %s", args.node_name, exc)
            if args.once:
                return 1 if failed else 0
            if stop.wait(args.interval):
                return 0
    finally:
        for discovery in discoveries:
            discovery.close()
