"""`wakegate catalog`: what OCI registries publish, and a Model manifest for one of it.

    wakegate catalog ls registry.example[/models] [--json]       # repository, tag, digest, size, facts
    wakegate catalog deploy registry.example/models/llama:q4 --as llama [--min 0] [-o llama.yaml]

`ls` pages through the registry's `_catalog` and every repository's tag list (`Link` headers)
and reads each tag's manifest (and ModelPack config) for its size and facts. `deploy` writes
a Model manifest whose source is the tag pinned by the digest it names now
(`oci://…:TAG@sha256:…`), which `wakegate up` serves as it is; with `--adapter-of BASE` it
writes a LoRAAdapter for that base instead. Credentials come from a Docker config and are never
printed. Errors are one line on stderr and status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from wakegate.control.delivery.catalog import adapter_document, model_document, table
from wakegate.control.delivery.console import RegistryOptions, add_registry_arguments
from wakegate.control.delivery.errors import DeliveryError, SourceError
from wakegate.control.delivery.listing import Limits, list_registry
from wakegate.control.delivery.registry import RegistryClient
from wakegate.control.delivery.sources import OciSource, parse_source
from wakegate.control.schema import NAME_PATTERN
from wakegate.process import add_log_level, settings_from, start

ACTIONS = ("ls", "deploy")
#: the server-side apply field manager of `deploy --apply`
FIELD_MANAGER = "wakegate-catalog"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_registry_arguments(parser)
    add_log_level(parser)
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    ls = sub.add_parser("ls", help="list repositories and tags of a registry")
    ls.add_argument("target", metavar="REGISTRY[/PREFIX]", help="a registry host, optionally with a repository prefix")
    ls.add_argument("--json", action="store_true", help="one JSON object per entry on stdout")
    ls.add_argument("--page", type=int, default=100, help="names asked for per page of a listing")
    deploy = sub.add_parser("deploy", help="write a Model manifest serving one tag, pinned by its digest")
    deploy.add_argument("target", metavar="REGISTRY/REPO[:TAG]", help="the artifact (tag `latest` when none)")
    deploy.add_argument("--as", dest="model", required=True, metavar="MODEL", help="the Model's name")
    deploy.add_argument("--min", dest="min_replicas", type=int, default=0, help="replicas kept running")
    deploy.add_argument("--backend", default="llamacpp", help="the backend plugin serving it")
    deploy.add_argument("--adapter-of", default=None, metavar="BASE",
                        help="the artifact is a LoRA adapter: write a LoRAAdapter on the Model BASE instead")
    deploy.add_argument("-o", "--output", type=Path, default=None, metavar="FILE",
                        help="write the manifest here (default: stdout)")
    deploy.add_argument("--apply", action="store_true",
                        help="create (server-side apply) the object on the cluster instead of writing it")
    deploy.add_argument("-n", "--namespace", default="default", help="the namespace `--apply` creates it in")
    deploy.add_argument("--kubeconfig", default=None, metavar="FILE",
                        help="the cluster for --apply (default: $KUBECONFIG, else in-cluster, else ~/.kube/config)")


@dataclass(frozen=True, kw_only=True)
class Settings(RegistryOptions):
    """One `wakegate catalog` invocation."""

    action: str
    """ls or deploy."""
    target: str
    """`ls`: REGISTRY[/PREFIX]; `deploy`: REGISTRY/REPO[:TAG]."""
    json: bool = False
    """`ls` as JSON lines."""
    page: int = 100
    """Names per listing page."""
    model: str | None = None
    """The Model `deploy` writes."""
    min_replicas: int = 0
    """The Model's scaling.min."""
    backend: str = "llamacpp"
    """The Model's backend."""
    adapter_of: str | None = None
    """`deploy` a LoRAAdapter on this base Model."""
    output: Path | None = None
    """Where `deploy` writes (None: stdout)."""
    apply: bool = False
    """`deploy` onto the cluster instead of writing a file."""
    namespace: str = "default"
    """The namespace `--apply` creates the object in."""
    kubeconfig: str | None = None
    """Where the cluster is, for `--apply`."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        target = str(args.target).removeprefix("oci://")
        if args.action == "deploy":
            if not re.match(NAME_PATTERN, args.model) or len(args.model) > 60:
                raise ValueError(f"--as {args.model!r}: a Model name is lower-case letters, digits and '-'")
            if args.min_replicas < 0:
                raise ValueError("--min must be 0 or more")
            if args.apply and args.output is not None:
                raise ValueError("--apply and -o are one or the other")
            _artifact(target)
        elif not target.split("/", 1)[0]:
            raise ValueError(f"{args.target!r}: name a registry host")
        if getattr(args, "page", 100) < 1:
            raise ValueError("--page must be at least 1")
        return settings_from(cls, args, target=target)


def _artifact(target: str) -> OciSource:
    name = target if ":" in target.rsplit("/", 1)[-1] or "@" in target else f"{target}:latest"
    source = parse_source(f"oci://{name}")
    if not isinstance(source, OciSource):
        raise SourceError(f"{target}: not an OCI reference")
    return source


def main(args: argparse.Namespace) -> int:
    return start(args, Settings.from_args, run, "catalog")


def run(s: Settings) -> int:
    try:
        return _ls(s) if s.action == "ls" else _deploy(s)
    except DeliveryError as exc:
        print(f"wakegate catalog {s.action}: {exc}", file=sys.stderr, flush=True)
        return 1


def _ls(s: Settings) -> int:
    registry, _, prefix = s.target.partition("/")
    result = asyncio.run(list_registry(registry, [prefix] if prefix else [], s.registry_settings(),
                                       limits=Limits(page=s.page)))
    if result.failure is not None:
        print(f"wakegate catalog ls: {result.failure[1]}", file=sys.stderr, flush=True)
        return 1
    entries = sorted(result.entries, key=lambda e: (e.repository, e.tag))
    if s.json:
        for entry in entries:
            print(json.dumps({"registry": registry, **entry.to_json(), "source": entry.reference(registry)}))
    else:
        for line in table(entries):
            print(line)
        repositories = len({e.repository for e in entries})
        print(f"{len(entries)} tags in {repositories} repositories on {registry}")
    for line in result.errors:
        print(f"wakegate catalog ls: {line}", file=sys.stderr)
    return 1 if result.errors else 0


async def _digest(s: Settings, artifact: OciSource) -> str:
    if artifact.digest:
        return artifact.digest
    assert artifact.tag is not None
    async with RegistryClient(artifact.registry, s.registry_settings()) as client:
        digest, _, _ = await client.manifest(artifact.repository, artifact.tag)
    return digest


def _deploy(s: Settings) -> int:
    assert s.model is not None
    artifact = _artifact(s.target)
    digest = asyncio.run(_digest(s, artifact))
    tag = f":{artifact.tag}" if artifact.tag else ""
    source = f"oci://{artifact.registry}/{artifact.repository}{tag}@{digest}"
    if s.adapter_of:
        doc = adapter_document(s.model, source, s.adapter_of)
    else:
        doc = model_document(s.model, source, s.backend, s.min_replicas)
    if s.apply:
        return _apply(s, doc, source)
    text = "---\n" + yaml.safe_dump(doc, sort_keys=False)
    if s.output is None:
        sys.stdout.write(text)
    else:
        s.output.write_text(text)
        print(f"wrote {doc['kind']} {s.model} ({source}) to {s.output}", file=sys.stderr)
    return 0


def _apply(s: Settings, doc: dict[str, Any], source: str) -> int:
    """Server-side apply `doc` in `s.namespace` as the field manager `wakegate-catalog`."""
    from kubernetes.config import ConfigException

    from wakegate.control.k8s.client import Kube, KubeError, api_client

    doc = {**doc, "metadata": {**doc["metadata"], "namespace": s.namespace}}
    try:
        kube = Kube(api_client(s.kubeconfig))
        kube.apply(doc, field_manager=FIELD_MANAGER)
    except KubeError as exc:
        print(f"wakegate catalog deploy: the cluster refused {doc['kind']} {s.namespace}/{s.model}: "
              f"{exc.status} {exc.message}", file=sys.stderr, flush=True)
        return 1
    except (OSError, ValueError, ConfigException) as exc:  # no cluster configured, or an unusable kubeconfig
        print(f"wakegate catalog deploy: no cluster to apply to: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"applied {doc['kind']} {s.namespace}/{s.model} ({source})", file=sys.stderr)
    return 0
