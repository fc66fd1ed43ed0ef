"""A ModelCatalog refreshed by the operator's reconciler against the real registry (htpasswd):
credentials from its dockerconfigjson Secret, entries and printer-column fields in the status it
patches, a refused Secret as a Ready=False reason, and no password anywhere in the status.
The API server is a recording stand-in (the cluster test is e2e's)."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import pytest

from e2e.tools.registry import start_registry
from tests.control.delivery.conftest import weights
from tests.control.operator.recording import RecordingKube
from tests.support.tools import registry_bin
from wakegate.control.delivery.pushing import push
from wakegate.control.delivery.registry import RegistrySettings
from wakegate.control.operator import render as rnd
from wakegate.control.operator.controller import Reconciler
from wakegate.control.operator.keys import CATALOG_KEY

__all__ = ["registry_bin"]
pytestmark = pytest.mark.usefixtures("registry_bin")


def body(registry: str, secret: str | None, token: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"registry": registry, "repositories": ["models"], "refreshSeconds": 60}
    if secret:
        spec["credentials"] = {"name": secret}
    meta: dict[str, Any] = {"name": "reg", "namespace": "ns", "generation": 2, "uid": "u1"}
    if token:
        meta["annotations"] = {"wakegate.io/refresh": token}
    return {"apiVersion": "wakegate.io/v1alpha1", "kind": "ModelCatalog", "metadata": meta, "spec": spec}


def test_the_reconciler_lists_a_catalog_into_its_status(tmp_path: Path) -> None:
    with start_registry(tmp_path / "reg", auth=True) as reg:
        assert reg.credentials is not None
        settings = RegistrySettings(docker_config=reg.docker_config)
        digests = [
            asyncio.run(
                push(
                    weights(tmp_path / f"m{i}", 1024 + i, f"m{i}-Q4_0.gguf"),
                    f"oci://{reg.host}/models/m{i}:v1",
                    settings=settings,
                )
            )
            for i in range(3)
        ]
        asyncio.run(push(weights(tmp_path / "other", 100), f"oci://{reg.host}/other/x:v1", settings=settings))
        config = base64.b64encode(reg.docker_config.read_bytes()).decode()
        kube = RecordingKube({"creds": {"data": {".dockerconfigjson": config}}})
        reconciler = Reconciler(kube, rnd.Settings())  # type: ignore[arg-type]

        reconciler.on_catalog("ADDED", body(reg.host, "creds", token="1"))
        asyncio.run(reconciler.reconcile(CATALOG_KEY + "ns/reg"))
        ((where, status),) = kube.patched
        assert where.endswith("/namespaces/ns/modelcatalogs/reg")
        assert [
            (e["repository"], e["digest"], e["size"], e["format"], e["quantization"]) for e in status["entries"]
        ] == [(f"models/m{i}", digests[i], 1024 + i, "gguf", "Q4_0") for i in range(3)]
        assert (status["entryCount"], status["observedGeneration"], status["refreshToken"]) == (3, 2, "1")
        assert status["conditions"][0]["status"] == "True"
        assert reconciler.catalogs["ns/reg"]["status"] == status
        assert reg.credentials.password not in json.dumps(status)

        reconciler.on_catalog("MODIFIED", {**body(reg.host, "missing"), "status": status})
        asyncio.run(reconciler.reconcile(CATALOG_KEY + "ns/reg"))
        failed = kube.patched[-1][1]
        assert failed["entries"] == status["entries"]  # what was seen stays, Ready says why
        ready = failed["conditions"][0]
        assert (ready["status"], ready["reason"]) == ("False", "bad_credentials")
        assert "ns/missing does not exist" in ready["message"]

        reconciler.on_catalog("MODIFIED", body(reg.host, None))
        asyncio.run(reconciler.reconcile(CATALOG_KEY + "ns/reg"))
        anonymous = kube.patched[-1][1]["conditions"][0]
        assert (anonymous["status"], anonymous["reason"]) == ("False", "unauthorized")
        assert reg.credentials.password not in json.dumps(kube.patched)
