"""A ModelCatalog on the real control plane: `wakegate operator` (with exactly the chart's RBAC)
lists an htpasswd registry with the credentials of a dockerconfigjson Secret into the status,
`kubectl get mcat` shows the printer columns, a changed `wakegate.io/refresh` annotation lists
it again at once, and the password is in no status and no operator log line."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from e2e.gateway import LEASE_RULES, OPERATOR_RULES, Operator, install_crds, running, scoped_kubeconfig
from e2e.helpers import Kube
from e2e.tools.registry import Registry, start_registry
from tests.support.waiting import wait_for
from wakegate.control.delivery.pushing import push
from wakegate.control.delivery.registry import RegistrySettings

pytestmark = pytest.mark.e2e

GROUP, VERSION = "wakegate.io", "v1alpha1"


def _push(reg: Registry, work: Path, repo: str) -> str:
    work.mkdir(parents=True, exist_ok=True)
    model = work / f"{repo.replace('/', '-')}-Q4_0.gguf"
    model.write_bytes(repo.encode() * 100)
    return asyncio.run(push(model, f"oci://{reg.host}/{repo}:v1",
                            settings=RegistrySettings(docker_config=reg.docker_config)))


def _catalog(kube: Kube, name: str) -> dict[str, Any]:
    try:
        body: dict[str, Any] = kube.custom.get_namespaced_custom_object(GROUP, VERSION, kube.ns, "modelcatalogs", name)
    except ApiException as exc:
        if exc.status == 404:
            return {}
        raise
    return body


def test_a_modelcatalog_lists_its_registry_on_demand_with_secret_credentials(kube: Kube, tmp_path: Path) -> None:
    install_crds(kube.api)
    with start_registry(tmp_path / "reg", auth=True) as reg:
        assert reg.credentials is not None
        digests = {repo: _push(reg, tmp_path / "src", repo) for repo in ("models/a", "models/b", "other/c")}
        kube.core.create_namespaced_secret(kube.ns, {
            "metadata": {"name": "regcred"}, "type": "kubernetes.io/dockerconfigjson",
            "data": {".dockerconfigjson": base64.b64encode(reg.docker_config.read_bytes()).decode()},
        })
        kube.custom.create_namespaced_custom_object(GROUP, VERSION, kube.ns, "modelcatalogs", {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "ModelCatalog",
            "metadata": {"name": "local", "annotations": {"wakegate.io/refresh": "1"}},
            "spec": {"registry": reg.host, "repositories": ["models"], "credentials": {"name": "regcred"},
                     "refreshSeconds": 3600},
        })
        with (scoped_kubeconfig(kube, tmp_path, "operator", OPERATOR_RULES, LEASE_RULES) as kubeconfig,
              running(Operator(tmp_path, kubeconfig, kube.ns, "operator", ["--renew-seconds", "1"]))):
            listed = wait_for(lambda: (_catalog(kube, "local").get("status") or {}).get("entries") or [], 60,
                              "the catalog's entries")
            assert [(e["repository"], e["digest"], e["format"], e["quantization"]) for e in listed] == [
                ("models/a", digests["models/a"], "gguf", "Q4_0"), ("models/b", digests["models/b"], "gguf", "Q4_0")]
            status = _catalog(kube, "local")["status"]
            assert status["conditions"][0]["status"] == "True" and status["refreshToken"] == "1"

            columns = subprocess.run(
                ["kubectl", "--kubeconfig", str(kube.cluster.kubeconfig), "-n", kube.ns, "get", "mcat", "local"],
                capture_output=True, text=True, check=True, timeout=60).stdout.splitlines()
            assert columns[0].split()[:6] == ["NAME", "REGISTRY", "ENTRIES", "LAST", "REFRESH", "READY"]
            assert columns[1].split()[:3] == ["local", reg.host, "2"]

            # Published after the listing; the interval is an hour, the annotation asks now.
            digests["models/d"] = _push(reg, tmp_path / "src", "models/d")
            kube.custom.patch_namespaced_custom_object(GROUP, VERSION, kube.ns, "modelcatalogs", "local",
                                                       {"metadata": {"annotations": {"wakegate.io/refresh": "2"}}})
            again = wait_for(lambda: len((_catalog(kube, "local").get("status") or {}).get("entries") or []) == 3,
                             30, "the refreshed catalog")
            assert again
            final = _catalog(kube, "local")["status"]
            assert final["refreshToken"] == "2"
            assert [e["repository"] for e in final["entries"]] == ["models/a", "models/b", "models/d"]
        assert reg.credentials.password not in json.dumps(final)
        log = (tmp_path / "operator.log").read_text()
        assert reg.credentials.password not in log
        assert "Forbidden" not in log, log[-3000:]
