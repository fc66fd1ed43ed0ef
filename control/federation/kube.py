"""The federation's kinds as the federation cluster holds them: listing, validating, their Secrets.

Both `wakegate federation controller` and `wakegate federation gateway --kubeconfig` read
Clusters, FederatedModels and a GlobalProxy through the one Kubernetes seam (`k8s.client.Kube`,
calls in threads). An object that does not validate is skipped with one log line (per object,
not per pass); a Secret's value is returned, never logged.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from wakegate.control.federation.members import free_gpus
from wakegate.control.federation.probe import TlsMaterial
from wakegate.control.federation_schema import Cluster, ClusterSecretRef, FederatedModel, Federation, GlobalProxy
from wakegate.control.k8s.client import Kube, KubeError
from wakegate.control.schema import GROUP, VERSION

log = logging.getLogger("wakegate.federation")

BASE = f"/apis/{GROUP}/{VERSION}"
CLUSTERS = f"{BASE}/clusters"
FEDERATED_MODELS = f"{BASE}/federatedmodels"

_Kind = TypeVar("_Kind", bound=BaseModel)


def proxy_path(namespace: str, name: str) -> str:
    return f"{BASE}/namespaces/{namespace}/globalproxies/{name}"


def valid(kind: type[_Kind], items: list[dict[str, Any]], refuse: Callable[[str, str], None]) -> list[_Kind]:
    """The items that validate as `kind` (their status and the server's metadata left aside)."""
    out = []
    for item in items:
        try:
            out.append(
                kind.model_validate({k: item[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in item})
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            refuse(f"{kind.__name__}/{item.get('metadata', {}).get('name', '?')}", f"{where}: {first['msg']}")
    return out


async def secret(host: Kube, ref: ClusterSecretRef | None) -> str | None:
    """The value of a Secret's key; KubeError when the Secret or the key is missing."""
    if ref is None:
        return None
    body = await asyncio.to_thread(host.get, f"/api/v1/namespaces/{ref.namespace}/secrets/{ref.name}")
    value = (body.get("data") or {}).get(ref.key)
    if value is None:
        raise KubeError(404, "Not Found", f"secret {ref.namespace}/{ref.name} has no key {ref.key}")
    return base64.b64decode(value).decode()


async def tls_material(host: Kube, cluster: Cluster) -> TlsMaterial | None:
    """An https:// member's CA (its `gateway.ca`) and client certificate (`gateway.clientCert`, its
    key the same Secret's `tls.key`); None: a plain member. KubeError when a Secret or key is missing."""
    gateway = cluster.spec.gateway
    ca = await secret(host, gateway.ca)
    if ca is None:
        return None
    cert = await secret(host, gateway.clientCert)
    key = None
    if gateway.clientCert is not None:
        key = await secret(host, gateway.clientCert.model_copy(update={"key": "tls.key"}))
    return TlsMaterial(ca, cert, key)


async def read_federation(
    host: Kube, proxy_namespace: str, proxy_name: str, refuse: Callable[[str, str], None]
) -> tuple[Federation, dict[str, str], dict[str, TlsMaterial]]:
    """The GlobalProxy, every valid Cluster, the FederatedModels of the proxy's namespace, and the
    member tokens and TLS material by cluster (KubeError when the proxy cannot be read)."""
    raw = await asyncio.to_thread(host.get, proxy_path(proxy_namespace, proxy_name))
    found = valid(GlobalProxy, [raw], refuse)
    if not found:
        raise KubeError(422, "Invalid", f"GlobalProxy {proxy_namespace}/{proxy_name} does not validate")
    proxy = found[0]
    items = (await asyncio.to_thread(host.get, CLUSTERS))["items"]
    clusters = valid(Cluster, items, refuse)
    # What the controller last counted free wins over the accelerators a Cluster says it offers:
    # the member to wake is the one with the most free now.
    free = {item["metadata"]["name"]: free_gpus(item.get("status")) for item in items}
    clusters = [
        c
        if free.get(c.name) is None
        else c.model_copy(update={"spec": c.spec.model_copy(update={"gpus": free[c.name]})})
        for c in clusters
    ]
    listed = await asyncio.to_thread(host.get, f"{BASE}/namespaces/{proxy_namespace}/federatedmodels")
    models = valid(FederatedModel, listed["items"], refuse)
    tokens = {}
    for cluster in clusters:
        try:
            token = await secret(host, cluster.spec.gateway.token)
        except KubeError as exc:
            refuse(f"cluster/{cluster.name} token", exc.message)
            continue
        if token is not None:
            tokens[cluster.name] = token
    tls = {}
    for cluster in clusters:
        try:
            material = await tls_material(host, cluster)
        except KubeError as exc:
            refuse(f"cluster/{cluster.name} tls", exc.message)
            continue
        if material is not None:
            tls[cluster.name] = material
    return Federation(clusters, models, proxy), tokens, tls
