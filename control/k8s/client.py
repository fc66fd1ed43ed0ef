"""Thin synchronous Kubernetes REST adapter: server-side apply, status patches, deletes, reads.

The generated `kubernetes` API classes cover neither server-side apply nor
custom resources in one shape, so everything here goes through the client's
own connection pool and credentials with plain JSON bodies. Callers run these
in threads (`asyncio.to_thread`); each method is one HTTP request.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

from kubernetes import client, config

from wakegate.control.k8s import names

#: (apiVersion, kind) -> plural resource name, for every kind wakegate writes or reads.
PLURALS: dict[tuple[str, str], str] = {
    ("v1", "Service"): "services",
    ("v1", "Pod"): "pods",
    ("apps/v1", "Deployment"): "deployments",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobjects",
    ("coordination.k8s.io/v1", "Lease"): "leases",
    (names.API_VERSION, "Model"): names.MODEL_PLURAL,
    (names.API_VERSION, "InferenceRuntime"): names.RUNTIME_PLURAL,
    ("apiextensions.k8s.io/v1", "CustomResourceDefinition"): "customresourcedefinitions",
}
CLUSTER_SCOPED = frozenset({"InferenceRuntime", "CustomResourceDefinition"})


class KubeError(RuntimeError):
    def __init__(self, status: int, reason: str, body: str) -> None:
        try:
            message = json.loads(body).get("message", body)
        except ValueError:
            message = body
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.message = str(message)


def api_client(kubeconfig: str | None, pool_size: int = 16) -> client.ApiClient:
    """An ApiClient from a kubeconfig file (else $KUBECONFIG / ~/.kube/config, else in-cluster)."""
    configuration = client.Configuration()
    try:
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    except config.ConfigException:
        if kubeconfig is not None:
            raise
        config.load_incluster_config(client_configuration=configuration)
    configuration.connection_pool_maxsize = pool_size
    return client.ApiClient(configuration)


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

    def request(
        self,
        method: str,
        resource: str,
        body: Any = None,
        query: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        timeout: float = 30.0,
    ) -> Any:
        url = self.api.configuration.host + resource + (f"?{urlencode(query)}" if query else "")
        headers = {"Accept": "application/json", "Content-Type": content_type}
        self.api.update_params_for_auth(headers, [], ["BearerToken"], resource, method, body)
        response = self.api.rest_client.request(method, url, headers=headers, body=body, _request_timeout=timeout)
        data = response.read()
        text = data.decode() if isinstance(data, bytes) else str(data)
        if not 200 <= response.status < 300:
            raise KubeError(response.status, response.reason or "", text)
        return json.loads(text) if text else None

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

    def patch_status(self, obj_path: str, status: Mapping[str, Any]) -> Any:
        body = {"status": status}
        return self.request(
            "PATCH", obj_path + "/status", body, {"fieldManager": names.FIELD_MANAGER}, "application/merge-patch+json"
        )

    def delete(self, resource: str) -> bool:
        """Delete with background propagation; False when it did not exist."""
        try:
            self.request("DELETE", resource, {"propagationPolicy": "Background"})
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True
