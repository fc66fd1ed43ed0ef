"""The federation controller: FederatedModels written into member clusters, statuses written back.

Every `interval` seconds it lists the federation cluster's Clusters and FederatedModels and:

1. probes each Cluster's gateway (`GET /wakegate/status`, the token from the Cluster's Secret);
2. for each Cluster with a kubeconfig Secret, server-side-applies the Model of every
   FederatedModel placed there (`members.member_model`, field manager `wakegate-federation`,
   so anything another manager set stays its own), reads the Model's status back, and deletes
   the Models it wrote earlier (label `wakegate.io/federated-model`) that are no longer placed
   there;
3. writes each Cluster's status (reachable, latency, models and readiness, last seen) and each
   FederatedModel's (one entry per placed cluster, the `east=Ready west=Idle` summary).

A level-triggered loop over lists, not watches: the member clusters are other API servers
(their watches would be one more connection per member to keep alive), the probe is a poll
anyway, and a pass costs a few requests per member (docs/decisions.md, "Federation").
Credentials come only from Secrets and are never logged.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import yaml
from kubernetes import client, config

from wakegate.control.federation import members as fed
from wakegate.control.federation.kube import BASE, CLUSTERS, FEDERATED_MODELS, secret, tls_material, valid
from wakegate.control.federation.members import FEDERATED_LABEL, FIELD_MANAGER, Member, MemberHealth
from wakegate.control.federation.probe import ProbeFailed, Tls, probe
from wakegate.control.federation_schema import Cluster, FederatedModel
from wakegate.control.k8s.client import Kube, KubeError

log = logging.getLogger("wakegate.federation")

_BASE = BASE


def _models_path(namespace: str, name: str | None = None) -> str:
    return f"{_BASE}/namespaces/{namespace}/models" + (f"/{name}" if name else "")


@dataclass
class _MemberClient:
    version: str
    kube: Kube


@dataclass
class Controller:
    host: Kube
    interval: float = 5.0
    probe_timeout: float = 2.0
    unhealthy_threshold: int = 1
    health: dict[str, MemberHealth] = field(default_factory=dict)
    seen_at: dict[str, float] = field(default_factory=dict)
    _clients: dict[str, _MemberClient] = field(default_factory=dict)
    _refused: set[str] = field(default_factory=set)

    async def run(self, stop: asyncio.Event) -> None:
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                try:
                    await self.reconcile(session)
                except KubeError as exc:
                    log.warning("federation pass failed: %s", exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval)

    # -- one pass ----------------------------------------------------------------------------------

    async def reconcile(self, session: aiohttp.ClientSession) -> None:
        clusters = valid(Cluster, (await asyncio.to_thread(self.host.get, CLUSTERS))["items"], self._refuse)
        models = valid(
            FederatedModel, (await asyncio.to_thread(self.host.get, FEDERATED_MODELS))["items"], self._refuse
        )
        members: dict[str, Member] = {}
        for cluster in clusters:
            try:
                members[cluster.name] = fed.member_of(cluster)
            except ValueError as exc:
                self._refuse(f"cluster/{cluster.name}", str(exc))
        await asyncio.gather(*(self._probe(session, c, members[c.name]) for c in clusters if c.name in members))
        phases: dict[str, dict[str, Mapping[str, Any] | None]] = {fed.model_key(m): {} for m in models}
        for cluster in clusters:
            member = members.get(cluster.name)
            kube = await self._member_kube(cluster)
            if member is None or kube is None:
                continue
            placed_here = [m for m in models if member in fed.placed(m, members.values())]
            for model in placed_here:
                phases[fed.model_key(model)][cluster.name] = await self._apply(kube, cluster.name, model)
            await self._collect_garbage(kube, cluster.name, placed_here)
        for cluster in clusters:
            status = fed.cluster_status(self.health.get(cluster.name), self.seen_at.get(cluster.name))
            member_client = self._clients.get(cluster.name)
            if member_client is not None:
                gpus = await self._gpus(member_client.kube, cluster.name)
                if gpus is not None:
                    status["gpus"] = gpus
            await self._write_status(f"{CLUSTERS}/{cluster.name}", status)
        for model in models:
            status = fed.federated_status(model, members.values(), self.health, phases[fed.model_key(model)])
            namespace = model.metadata.namespace or "default"
            await self._write_status(f"{_BASE}/namespaces/{namespace}/federatedmodels/{model.name}", status)

    def _refuse(self, what: str, why: str) -> None:
        if what not in self._refused:  # one line per object, not one per pass
            self._refused.add(what)
            log.warning("federation: skipping %s: %s", what, why)

    # -- members -----------------------------------------------------------------------------------

    async def _probe(self, session: aiohttp.ClientSession, cluster: Cluster, member: Member) -> None:
        state = self.health.get(cluster.name, MemberHealth())
        try:
            token = await secret(self.host, cluster.spec.gateway.token)
            material = await tls_material(self.host, cluster)
            if member.tls and material is None:
                raise ProbeFailed("tls: an https:// gateway's CA is a Secret on the cluster (gateway.ca)")
            tls = Tls.of(material, member.server_name) if material is not None else None
            report, latency = await probe(session, member.url, token, self.probe_timeout, tls)
        except (ProbeFailed, KubeError) as exc:
            self.health[cluster.name] = state.failed(str(exc), self.unhealthy_threshold)
            return
        self.health[cluster.name] = state.observed(report, latency, time.monotonic())
        self.seen_at[cluster.name] = time.time()

    async def _member_kube(self, cluster: Cluster) -> Kube | None:
        """A client of the member's API server from its kubeconfig Secret (rebuilt when it changes)."""
        ref = cluster.spec.kubeconfig
        if ref is None:
            return None
        try:
            body = await asyncio.to_thread(self.host.get, f"/api/v1/namespaces/{ref.namespace}/secrets/{ref.name}")
            version = str(body["metadata"].get("resourceVersion", ""))
            cached = self._clients.get(cluster.name)
            if cached is not None and cached.version == version:
                return cached.kube
            text = base64.b64decode((body.get("data") or {})[ref.key]).decode()
            configuration = client.Configuration()
            config.load_kube_config_from_dict(yaml.safe_load(text), client_configuration=configuration)
        except (KubeError, KeyError, ValueError, yaml.YAMLError, config.ConfigException) as exc:
            self._refuse(f"cluster/{cluster.name} kubeconfig", type(exc).__name__)
            return None
        kube = Kube(client.ApiClient(configuration))
        self._clients[cluster.name] = _MemberClient(version, kube)
        return kube

    async def _apply(self, kube: Kube, cluster: str, model: FederatedModel) -> Mapping[str, Any] | None:
        """Apply the member Model; its status as the member's operator wrote it (None: not readable)."""
        body = fed.member_model(model, model.metadata.namespace or "default")
        try:
            applied = await asyncio.to_thread(kube.apply, body, FIELD_MANAGER)
        except KubeError as exc:
            log.warning("federation: cannot apply Model %s in cluster %s: %s", model.name, cluster, exc)
            return None
        status: Mapping[str, Any] | None = applied.get("status")
        return status

    async def _collect_garbage(self, kube: Kube, cluster: str, placed_here: list[FederatedModel]) -> None:
        """Delete the Models this controller wrote in `cluster` that nothing places there any more."""
        wanted = {(m.metadata.namespace or "default", m.name) for m in placed_here}
        try:
            listed = await asyncio.to_thread(
                kube.request, "GET", f"{_BASE}/models", None, {"labelSelector": FEDERATED_LABEL}
            )
        except KubeError as exc:
            log.warning("federation: cannot list Models in cluster %s: %s", cluster, exc)
            return
        for item in listed.get("items", []):
            meta = item["metadata"]
            if (meta.get("namespace"), meta["name"]) not in wanted:
                log.info(
                    "federation: removing Model %s/%s from cluster %s", meta.get("namespace"), meta["name"], cluster
                )
                with contextlib.suppress(KubeError):
                    await asyncio.to_thread(kube.delete, _models_path(meta["namespace"], meta["name"]))

    async def _gpus(self, kube: Kube, cluster: str) -> dict[str, int] | None:
        """The member's accelerator summary (its Nodes' allocatable, its Pods' requests)."""
        try:
            nodes = await asyncio.to_thread(kube.get, "/api/v1/nodes")
            pods = await asyncio.to_thread(kube.get, "/api/v1/pods")
        except KubeError as exc:
            self._refuse(f"cluster/{cluster} capacity", exc.message)
            return None
        return fed.gpu_summary(nodes.get("items", []), pods.get("items", []))

    async def _write_status(self, resource: str, status: Mapping[str, Any]) -> None:
        try:
            await asyncio.to_thread(self.host.patch_status, resource, status)
        except KubeError as exc:
            log.warning("federation: cannot write the status of %s: %s", resource, exc)
