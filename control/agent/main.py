"""`wakegate agent`: the GPU node agent (one per node, a DaemonSet).

Finds the node's accelerators through :mod:`wakegate.control.gpu` (NVML, amdsmi, or a fake file for
tests) and writes what the scheduler extender reads onto the Node:

- labels `wakegate.io/gpu.vendor`, `gpu.arch`, `gpu.count`, `gpu.vram-mb` (per GPU, MiB);
- annotations `wakegate.io/gpu-free-memory-mb` (summed over the GPUs) and
  `wakegate.io/gpu-utilization` (mean percent), refreshed every `--interval` seconds.

It patches only keys whose value changed (one merge patch, never the whole Node). No GPU, no
library or a library that fails: the wakegate labels are removed (if present), one log line
says why, and the agent keeps running, so a driver that appears later is picked up.

With `--kv-cache-usage` it also writes `wakegate.io/kv-cache-usage`: the highest KV-cache usage
(0..1) the engines of the wakegate backend pods on this node report in their metrics
(:mod:`wakegate.control.agent.kvcache`), which the scheduler extender weighs.

With `--cache-dir` (the node's model cache, a hostPath in the DaemonSet) it also prewarms:
:mod:`wakegate.control.agent.prewarm` pulls what the ModelCaches want on this node into that
cache, reports per-node status into them and labels the Node with what the cache holds.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from wakegate.control.agent.kvcache import KvCacheReader
from wakegate.control.agent.labels import ANNOTATIONS, Report, node_report, patch_for
from wakegate.control.gpu.discovery import Discovery, DiscoveryError, GpuDevice, probe
from wakegate.control.k8s import names
from wakegate.control.k8s.client import Kube, KubeError, add_kubeconfig, api_client, path
from wakegate.control.placement.facts import NODE_KV_CACHE_USAGE
from wakegate.process import ProcessSettings, add_log_level, graceful_exit, settings_from, start

log = logging.getLogger("wakegate.agent")


class NodeAgent:
    def __init__(
        self,
        kube: Kube,
        node: str,
        discoveries: list[Discovery],
        problems: list[str],
        kv: KvCacheReader | None = None,
    ) -> None:
        self.kube = kube
        self.kv = kv
        self._kv_failed = False
        self.node = node
        self._path = path("v1", "Node", None, node)
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
            meta = self.kube.get(self._path).get("metadata") or {}
            self.labels = dict(meta.get("labels") or {})
            self.annotations = dict(meta.get("annotations") or {})
        devices, problems = self.devices()
        report = node_report(devices)
        if devices:
            self._say(f"node {self.node}: {len(devices)} GPU(s), labels {report.labels}")
        else:
            why = "; ".join(problems) or "the GPU libraries found no device"
            self._say(f"node {self.node}: no GPU found ({why}); the node gets no wakegate GPU labels")
        report, keys = self._with_kv(report)
        patch = patch_for(report, self.labels, self.annotations, keys)
        if patch is None:
            return False
        self.kube.merge_patch(self._path, patch, names.AGENT_FIELD_MANAGER)
        for key, value in patch["metadata"].get("labels", {}).items():
            self._set(self.labels, key, value)
        for key, value in patch["metadata"].get("annotations", {}).items():
            self._set(self.annotations, key, value)
        log.debug("patched node %s: %s", self.node, patch)
        return True

    def _with_kv(self, report: Report) -> tuple[Report, tuple[str, ...]]:
        """The report with the node's KV-cache usage, and the annotation keys it decides.

        When the pods cannot be listed the annotation is left as it is (not removed) this round.
        """
        if self.kv is None:
            return report, ANNOTATIONS
        try:
            usage = self.kv.usage()
        except (KubeError, OSError) as exc:
            if not self._kv_failed:
                log.warning("node %s: cannot list the backend pods for their KV-cache usage: %s", self.node, exc)
            self._kv_failed = True
            return report, ANNOTATIONS
        self._kv_failed = False
        annotations = dict(report.annotations)
        if usage is not None:
            annotations[NODE_KV_CACHE_USAGE] = usage
        return Report(report.labels, annotations), (*ANNOTATIONS, NODE_KV_CACHE_USAGE)

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
    add_kubeconfig(parser)
    a("--interval", type=float, default=15.0, help="seconds between refreshes of the annotations")
    a("--fake-gpus", type=Path, default=None, metavar="FILE",
      help="read GPUs from a JSON file instead of NVML/amdsmi (tests, demos; see control/gpu/fake.py)")
    a("--once", action="store_true", help="one round, then exit")
    a("--kv-cache-usage", action="store_true",
      help="also annotate the node with the highest KV-cache usage its wakegate engines report "
           "(lists the pods on this node: needs pods list)")
    a("--cache-dir", type=Path, default=None, metavar="DIR",
      help="the node's model cache (a hostPath): prewarm what ModelCaches want here; default: no prewarming")
    a("--cache-max-size", default=None, metavar="SIZE",
      help="size budget of the node cache, e.g. 200G (least recently used entries not in use are evicted)")
    a("--registry-ca-file", type=Path, default=None, metavar="PEM", help="extra CA certificates for registries")
    a("--retry-seconds", type=float, default=60.0, help="a failed prewarm pull is tried again after this long")
    a("--prepare-cache", type=int, default=None, metavar="UID",
      help="create --cache-dir, give it to UID (user and group, mode 0750), and exit: the DaemonSet's "
           "init container, which runs as root so the agent itself need not")
    add_log_level(parser)


@dataclass(frozen=True, kw_only=True)
class Settings(ProcessSettings):
    """Everything `wakegate agent` is configured with; built once from its command line."""

    node_name: str
    """The Node this agent labels."""
    kubeconfig: str | None
    """Where the cluster is (the seam's lookup order when None)."""
    interval: float
    """Seconds between refreshes of the annotations."""
    fake_gpus: Path | None
    """Read GPUs from this JSON file instead of NVML/amdsmi."""
    once: bool
    """One round, then exit (status 1 when it failed)."""
    cache_dir: Path | None = None
    """The node's model cache; None: no prewarming."""
    cache_max_size: str | None = None
    """Size budget of the node cache (`parse_size` syntax)."""
    registry_ca_file: Path | None = None
    """Extra CA certificates trusted for registries."""
    retry_seconds: float = 60.0
    """A failed prewarm pull is tried again after this long."""
    prepare_cache: int | None = None
    """Create the cache directory for this UID and exit."""
    kv_cache_usage: bool = False
    """Annotate the node with its engines' highest KV-cache usage."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        if not args.node_name:
            raise ValueError("no node name: pass --node-name or set NODE_NAME")
        if args.prepare_cache is not None and args.cache_dir is None:
            raise ValueError("--prepare-cache needs --cache-dir")
        if args.cache_max_size is not None:
            from wakegate.control.delivery.cache import parse_size

            parse_size(args.cache_max_size)
        return settings_from(cls, args)


def main(args: argparse.Namespace) -> int:
    return start(args, Settings.from_args, run, "agent")


def prepare_cache(directory: Path, uid: int) -> int:
    """The node cache directory, made and handed to `uid` (the kubelet creates a hostPath as root)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        os.chown(directory, uid, uid)
        directory.chmod(0o750)
    except OSError as exc:
        log.error("cannot prepare the node cache %s for uid %d: %s", directory, uid, exc.strerror)
        return 1
    log.info("node cache %s belongs to uid %d", directory, uid)
    return 0


def run(settings: Settings) -> int:
    from kubernetes.config import ConfigException

    if settings.prepare_cache is not None:
        assert settings.cache_dir is not None
        return prepare_cache(settings.cache_dir, settings.prepare_cache)

    from wakegate.control.gpu.fake import FakeDiscovery

    if settings.fake_gpus is not None:
        discoveries: list[Discovery] = [FakeDiscovery(settings.fake_gpus, settings.node_name)]
        problems: list[str] = []
    else:
        discoveries, problems = probe()
    try:
        kube = Kube(api_client(settings.kubeconfig))
    except (ConfigException, OSError) as exc:
        log.error("no Kubernetes configuration: %s", exc)
        return 2
    kv = KvCacheReader(kube, settings.node_name) if settings.kv_cache_usage else None
    agent = NodeAgent(kube, settings.node_name, discoveries, problems, kv)
    stop = threading.Event()
    graceful_exit(stop, "agent")
    prewarm = None
    if settings.cache_dir is not None and not settings.once:
        prewarm = _start_prewarm(settings, kube, stop)
    try:
        while True:
            failed = False
            try:
                agent.sync()
            except (KubeError, OSError) as exc:
                # Re-read the Node next round: our view of it may be stale.
                agent.labels = None
                failed = True
                log.warning("updating node %s failed: %s", settings.node_name, exc)
            if settings.once:
                return 1 if failed else 0
            if stop.wait(settings.interval):
                return 0
    finally:
        stop.set()
        if prewarm is not None:
            prewarm.join(10)
        for discovery in discoveries:
            discovery.close()


def _start_prewarm(settings: Settings, kube: Kube, stop: threading.Event) -> threading.Thread:
    from wakegate.control.agent.prewarm import Prewarmer
    from wakegate.control.delivery.cache import Cache, parse_size
    from wakegate.control.delivery.registry import RegistrySettings
    from wakegate.control.delivery.resolver import Access

    assert settings.cache_dir is not None
    budget = parse_size(settings.cache_max_size) if settings.cache_max_size else None
    cache = Cache(settings.cache_dir, budget)
    access = Access.from_env(RegistrySettings(ca_file=settings.registry_ca_file))
    prewarmer = Prewarmer(kube, settings.node_name, cache, access, interval=min(settings.interval, 5.0),
                          retry_seconds=settings.retry_seconds)
    log.info("node %s: prewarming into %s", settings.node_name, settings.cache_dir)
    thread = threading.Thread(target=prewarmer.run, args=(stop,), name="prewarm", daemon=True)
    thread.start()
    return thread
