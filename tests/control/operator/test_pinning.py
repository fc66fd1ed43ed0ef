"""A Model's oci:// tag pinned to a digest by the operator's reconciler against the real registry
(htpasswd, credentials from the Model's imagePullSecret): the pods' image volume and the status
name the digest the tag had at first, moving the tag in the registry changes neither, a new
spec.source is resolved anew, and the password appears in no status, object or log line.
The API server is a recording stand-in (the cluster test is e2e's)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from e2e.tools.registry import start_registry
from tests.control.delivery.conftest import weights
from tests.control.operator.recording import RecordingKube
from tests.support.tools import registry_bin
from wakegate.control.delivery.pushing import push
from wakegate.control.delivery.registry import RegistrySettings
from wakegate.control.k8s import names
from wakegate.control.k8s.objects import model_from_object
from wakegate.control.operator import pinning
from wakegate.control.operator import render as rnd
from wakegate.control.operator.controller import Reconciler
from wakegate.control.operator.weights import State, weights_for

__all__ = ["registry_bin"]
pytestmark = pytest.mark.usefixtures("registry_bin")


class Kube(RecordingKube):
    def image_volumes(self) -> set[str]:
        """The image references of the backend pods in the Deployments applied since the last call."""
        found = {
            volume["image"]["reference"]
            for obj in self.applied
            if obj["kind"] == "Deployment" and "template" in obj["spec"]  # not the replicas hand-off
            for volume in obj["spec"]["template"]["spec"].get("volumes", [])
            if "image" in volume
        }
        self.applied.clear()
        return found


def model(source: str, status: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "wakegate.io/v1alpha1",
        "kind": "Model",
        "metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": 1},
        "spec": {
            "backend": "sim",
            "source": source,
            "scaling": {"engine": "builtin"},
            "imagePullSecrets": [{"name": "regcred"}],
        },
    }
    if status is not None:
        body["status"] = status
    return body


def test_a_moving_tag_keeps_the_digest_the_operator_resolved(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with start_registry(tmp_path / "reg", auth=True) as reg:
        assert reg.credentials is not None
        settings = RegistrySettings(docker_config=reg.docker_config)

        def push_tag(name: str, tag: str) -> str:
            ref = f"oci://{reg.host}/models/tiny:{tag}"
            return asyncio.run(push(weights(tmp_path / name, 2048, "tiny.gguf"), ref, settings=settings))

        first = push_tag("a", "stable")
        config = base64.b64encode(reg.docker_config.read_bytes()).decode()
        kube = Kube({"regcred": {"data": {".dockerconfigjson": config}}})
        reconciler = Reconciler(kube, rnd.Settings())  # type: ignore[arg-type]
        stable = f"oci://{reg.host}/models/tiny:stable"

        with caplog.at_level(logging.DEBUG):
            reconciler.on_model("ADDED", model(stable))
            asyncio.run(reconciler.reconcile("ns/m"))
            status = kube.patched[-1][1]
            assert status["pinnedSource"] == f"{stable}@{first}"
            assert kube.image_volumes() == {f"{reg.host}/models/tiny:stable@{first}"}

            second = push_tag("b", "stable")  # the tag moves
            assert second != first
            # A later event (a restarted operator sees the recorded status) and a changed
            # Model that keeps its source: the pods still load the first digest.
            restarted = Reconciler(kube, rnd.Settings())  # type: ignore[arg-type]
            changed = model(stable, status)
            changed["spec"]["args"] = ["--verbose"]
            for rec in (reconciler, restarted):
                rec.on_model("MODIFIED", changed)
                asyncio.run(rec.reconcile("ns/m"))
                assert kube.image_volumes() == {f"{reg.host}/models/tiny:stable@{first}"}
                assert rec.models["ns/m"]["status"]["pinnedSource"] == f"{stable}@{first}"

            # A new spec.source is resolved again: it names the tag's digest now.
            third = push_tag("c", "next")
            reconciler.on_model("MODIFIED", model(f"oci://{reg.host}/models/tiny:next", status))
            asyncio.run(reconciler.reconcile("ns/m"))
            assert kube.patched[-1][1]["pinnedSource"] == f"oci://{reg.host}/models/tiny:next@{third}"
            assert kube.image_volumes() == {f"{reg.host}/models/tiny:next@{third}"}

            # A source that names a digest is used as written; the status keeps no pin.
            reconciler.on_model("MODIFIED", model(f"oci://{reg.host}/models/tiny@{second}", kube.patched[-1][1]))
            asyncio.run(reconciler.reconcile("ns/m"))
            assert kube.patched[-1][1]["pinnedSource"] is None
            assert kube.image_volumes() == {f"{reg.host}/models/tiny@{second}"}

        everything = json.dumps(kube.patched) + json.dumps(kube.applied) + caplog.text
        assert reg.credentials.password not in everything


def test_an_unresolvable_tag_renders_no_pods_and_says_why(tmp_path: Path) -> None:
    with start_registry(tmp_path / "reg", auth=True, access_log=True) as reg:
        kube = Kube({})  # the imagePullSecret is missing: the registry is asked anonymously

        def manifest_requests() -> int:
            return sum("/manifests/" in line for line in reg.requests())

        async def twice() -> None:
            reconciler = Reconciler(kube, rnd.Settings())  # type: ignore[arg-type]
            reconciler.on_model("ADDED", model(f"oci://{reg.host}/models/tiny:stable"))
            await reconciler.reconcile("ns/m")
            asked = manifest_requests()
            reconciler.on_pod("ADDED", {"metadata": {"name": "p", "namespace": "ns",
                                                     "labels": names.backend_labels("m")}})
            await reconciler.reconcile("ns/m")  # another event: the registry is not asked again yet
            assert asked > 0 and manifest_requests() == asked

        asyncio.run(twice())
        assert kube.image_volumes() == set()
        ready = next(c for c in kube.patched[-1][1]["conditions"] if c["type"] == "Ready")
        assert (ready["status"], ready["reason"]) == ("False", "unauthorized")
        assert f"oci://{reg.host}/models/tiny:stable" in ready["message"]
        assert kube.patched[-1][1]["pinnedSource"] is None


def test_a_modelcache_naming_the_tag_holds_the_pinned_weights() -> None:
    digest = "sha256:" + "1" * 64
    pinned = f"oci://reg.example/models/tiny:v1@{digest}"
    body = pinning.pinned_body(model("oci://reg.example/models/tiny:v1"), pinned)
    body["spec"]["cache"] = {"strategy": "node"}

    def cache(entry_digest: str) -> dict[str, Any]:
        entry = {"node": "n1", "source": "oci://reg.example/models/tiny:v1", "phase": "Ready",
                 "digest": entry_digest, "file": "tiny.gguf", "readyTime": "2026-12-01T00:00:00Z"}
        return {"metadata": {"name": "mine", "namespace": "ns"},
                "spec": {"sources": ["oci://reg.example/models/tiny:v1"]}, "status": {"nodes": [entry]}}

    parsed = model_from_object(body)
    held = weights_for(body, parsed, [cache(digest)])
    assert held is not None and (held.state, held.digest, held.owned_cache) == (State.READY, digest, None)
    moved = weights_for(body, parsed, [cache("sha256:" + "2" * 64)])  # the tag moved before this node pulled
    assert moved is not None and moved.state is State.PENDING and moved.digest is None
