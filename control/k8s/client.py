"""The one Kubernetes seam outside Kopf: how a component finds its cluster, and plain-JSON access to it.

`api_client()` finds the cluster in one order for every component: the `--kubeconfig` file
given, else `$KUBECONFIG`, else the pod's service account (in-cluster, when
`KUBERNETES_SERVICE_HOST` is set), else `~/.kube/config`. Kopf (the operator, the xDS
feeder) logs in with the same credentials (`connection_info`).

`Kube` is the access style: the generated `kubernetes` API classes cover neither
server-side apply nor custom resources in one shape, so every read, write and watch goes
through the client's own connection pool and credentials with plain JSON bodies and
answers. Callers run these in threads (`asyncio.to_thread`, or a watch thread); each
method is one HTTP request. Errors are `KubeError` (status 0: no answer from the server).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlencode

import urllib3
from kubernetes import client, config

from wakegate.control.k8s import names

#: (apiVersion, kind) -> plural resource name, for every kind wakegate writes or reads.
PLURALS: dict[tuple[str, str], str] = {
    ("v1", "Service"): "services",
    ("v1", "Pod"): "pods",
    ("v1", "Node"): "nodes",
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Secret"): "secrets",
    ("apps/v1", "Deployment"): "deployments",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobjects",
    ("keda.sh/v1alpha1", "TriggerAuthentication"): "triggerauthentications",
    ("coordination.k8s.io/v1", "Lease"): "leases",
    (names.API_VERSION, "Model"): names.MODEL_PLURAL,
    (names.API_VERSION, "InferenceRuntime"): names.RUNTIME_PLURAL,
    (names.API_VERSION, "ModelCache"): names.MODELCACHE_PLURAL,
    (names.API_VERSION, "ModelCatalog"): names.MODELCATALOG_PLURAL,
    (names.API_VERSION, "LoRAAdapter"): names.LORAADAPTER_PLURAL,
    ("apiextensions.k8s.io/v1", "CustomResourceDefinition"): "customresourcedefinitions",
}
CLUSTER_SCOPED = frozenset({"InferenceRuntime", "CustomResourceDefinition", "Node"})


class KubeError(RuntimeError):
    def __init__(self, status: int, reason: str, body: str) -> None:
        try:
            message = json.loads(body).get("message", body)
        except ValueError:
            message = body
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.message = str(message)


def api_client(kubeconfig: str | None = None, pool_size: int = 16) -> client.ApiClient:
    """An ApiClient for the cluster, found in the order the module docstring gives.

    Raises `config.ConfigException` or `OSError` when the chosen source is unusable.
    """
    configuration = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    elif os.environ.get("KUBECONFIG"):
        config.load_kube_config(client_configuration=configuration)  # $KUBECONFIG, a list of files allowed
    elif os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=configuration)
    else:
        config.load_kube_config(client_configuration=configuration)  # ~/.kube/config
    configuration.connection_pool_maxsize = pool_size
    return client.ApiClient(configuration)


def add_kubeconfig(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kubeconfig",
        default=None,
        metavar="FILE",
        help="kubeconfig file (default: $KUBECONFIG, else in-cluster, else ~/.kube/config)",
    )


def connection_info(configuration: client.Configuration) -> dict[str, Any]:
    """Keyword arguments for `kopf.ConnectionInfo` from a loaded client configuration."""
    header = (
        configuration.get_api_key_with_prefix("BearerToken")
        or configuration.get_api_key_with_prefix("authorization")
        or ""
    )
    scheme, _, token = header.partition(" ")
    return {
        "server": configuration.host,
        "ca_path": configuration.ssl_ca_cert,
        "insecure": not configuration.verify_ssl,
        "scheme": scheme or None,
        "token": token or None,
        "certificate_path": configuration.cert_file,
        "private_key_path": configuration.key_file,
    }


def path(api_version: str, kind: str, namespace: str | None = None, name: str | None = None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    out = base
    if namespace is not None and kind not in CLUSTER_SCOPED:
        out += f"/namespaces/{namespace}"
    out += "/" + PLURALS[(api_version, kind)]
    if name is not None:
        out += f"/{name}"
    return out


def object_path(obj: Mapping[str, Any]) -> str:
    meta = obj["metadata"]
    return path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])


class Kube:
    """One cluster connection. Methods return decoded JSON or raise KubeError."""

    def __init__(self, api: client.ApiClient) -> None:
        self.api = api

    def _send(
        self, method: str, resource: str, body: Any, query: Mapping[str, str] | None, content_type: str, timeout: float
    ) -> Any:
        url = self.api.configuration.host + resource + (f"?{urlencode(query)}" if query else "")
        headers = {"Accept": "application/json", "Content-Type": content_type}
        self.api.update_params_for_auth(headers, [], ["BearerToken"], resource, method, body)
        try:
            response = self.api.rest_client.request(method, url, headers=headers, body=body, _request_timeout=timeout)
        except urllib3.exceptions.HTTPError as exc:
            raise KubeError(0, "no answer", str(exc)) from None
        if not 200 <= response.status < 300:
            data = response.read()
            raise KubeError(response.status, response.reason or "", data.decode(errors="replace"))
        return response

    def request(
        self,
        method: str,
        resource: str,
        body: Any = None,
        query: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        timeout: float = 30.0,
    ) -> Any:
        response = self._send(method, resource, body, query, content_type, timeout)
        try:
            data = response.read()
        except urllib3.exceptions.HTTPError as exc:
            raise KubeError(0, "no answer", str(exc)) from None
        text = data.decode() if isinstance(data, bytes) else str(data)
        return json.loads(text) if text else None

    def watch(
        self, resource: str, resource_version: str, query: Mapping[str, str] | None = None, timeout_seconds: int = 300
    ) -> Iterator[dict[str, Any]]:
        """Watch events of a collection from `resource_version`, one dict (`type`, `object`) each.

        Ends when the server closes the watch (after about `timeout_seconds`). An expired
        version arrives as an ERROR event with status 410: list again.
        """
        params = {
            **(query or {}),
            "watch": "true",
            "resourceVersion": resource_version,
            "timeoutSeconds": str(timeout_seconds),
            "allowWatchBookmarks": "true",
        }
        response = self._send("GET", resource, None, params, "application/json", timeout_seconds + 30)
        pending = b""
        try:
            for chunk in response.response.stream(64 * 1024, decode_content=True):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield json.loads(line)
        except urllib3.exceptions.HTTPError as exc:
            raise KubeError(0, "watch broke", str(exc)) from None
        finally:
            response.response.release_conn()

    def get(self, resource: str) -> Any:
        return self.request("GET", resource)

    def get_or_none(self, resource: str) -> Any:
        try:
            return self.get(resource)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def apply(self, obj: Mapping[str, Any], field_manager: str = names.FIELD_MANAGER, force: bool = True) -> Any:
        """Server-side apply (PATCH application/apply-patch+yaml; JSON is YAML)."""
        query = {"fieldManager": field_manager, "force": "true" if force else "false"}
        return self.request("PATCH", object_path(obj), obj, query, "application/apply-patch+yaml")

    def apply_status(self, obj: Mapping[str, Any], field_manager: str) -> Any:
        """Server-side apply of `obj["status"]` (the status subresource) as `field_manager`: list
        entries keyed in the schema (`x-kubernetes-list-map-keys`) are merged per key, so managers
        that each apply their own entries never overwrite one another."""
        query = {"fieldManager": field_manager, "force": "true"}
        return self.request("PATCH", object_path(obj) + "/status", obj, query, "application/apply-patch+yaml")

    def merge_patch(self, resource: str, patch: Mapping[str, Any], field_manager: str = names.FIELD_MANAGER) -> Any:
        return self.request(
            "PATCH", resource, patch, {"fieldManager": field_manager}, "application/merge-patch+json"
        )

    def patch_status(self, obj_path: str, status: Mapping[str, Any]) -> Any:
        return self.merge_patch(obj_path + "/status", {"status": status})

    def delete(self, resource: str) -> bool:
        """Delete with background propagation; False when it did not exist."""
        try:
            self.request("DELETE", resource, {"propagationPolicy": "Background"})
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True
