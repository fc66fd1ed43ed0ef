"""The agent's prewarm loop against a real registry and a real node cache; the API server is a
recording stand-in (the real one is e2e/test_prewarm.py)."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import pytest

from e2e.tools.registry import Registry, start_registry
from tests.control.delivery.conftest import weights
from tests.support.fakekube import FakeApiServer
from tests.support.tools import registry_bin
from wakegate.control.agent.prewarm import Prewarmer
from wakegate.control.delivery.cache import Cache
from wakegate.control.delivery.pushing import push
from wakegate.control.delivery.registry import RegistrySettings
from wakegate.control.delivery.resolver import Access
from wakegate.control.k8s import names
from wakegate.control.k8s.client import object_path

__all__ = ["registry_bin"]
pytestmark = pytest.mark.usefixtures("registry_bin")

NODE = "n1"


class Mirror:
    def __init__(self, *items: dict[str, Any]) -> None:
        self.objects = list(items)

    def items(self) -> list[dict[str, Any]]:
        return list(self.objects)


class Cluster:
    """The fake API server (tests/support/fakekube.py) with this Node, the Secrets and the
    ModelCaches, read back as the agent left them."""

    def __init__(self, secrets: dict[str, dict[str, Any]] | None = None) -> None:
        self.server = FakeApiServer()
        self.node = f"/api/v1/nodes/{NODE}"
        self.server.add(self.node, {"metadata": {"name": NODE, "labels": {"pool": "a"}}})
        for name, body in (secrets or {}).items():
            self.server.add(f"/api/v1/namespaces/ns/secrets/{name}", {"metadata": {"name": name}, **body})

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.server.objects[self.node]["metadata"]["labels"])

    @property
    def status(self) -> dict[str, list[dict[str, Any]]]:
        """ModelCache name -> the node entries of its status (those the agent wrote one to)."""
        return {
            obj["metadata"]["name"]: obj["status"]["nodes"]
            for obj in self.server.objects.values()
            if obj.get("kind") == "ModelCache" and "status" in obj
        }

    @property
    def applied(self) -> list[tuple[dict[str, Any], str]]:
        """Each status the agent applied, with its field manager."""
        return [(c.body, c.query["fieldManager"]) for c in self.server.writes("PATCH", "/status")]


def modelcache(name: str, source: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": names.API_VERSION,
        "kind": "ModelCache",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"sources": [source], **spec},
    }


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def prewarmer(kube: Cluster, cache_dir: Path, clock: Clock, *caches: dict[str, Any]) -> Prewarmer:
    for cache in caches:
        kube.server.add(object_path(cache), cache)
    agent = Prewarmer(
        kube.server.kube(),
        NODE,
        Cache(cache_dir),
        Access(RegistrySettings()),
        retry_seconds=30,  # type: ignore[arg-type]
        clock=clock,
    )
    agent.caches = Mirror(*caches)  # type: ignore[assignment]
    agent.models = Mirror()  # type: ignore[assignment]
    return agent


async def settle(agent: Prewarmer, rounds: int = 3) -> None:
    """Rounds until the pulls it started are done (and their outcome written)."""
    for _ in range(rounds):
        await agent.round()
        tasks = [p.task for p in agent.pulls.values() if p.task is not None and not p.task.done()]
        if tasks:
            await asyncio.gather(*tasks)
    await agent.round()


def published(reg: Registry, tmp_path: Path, ref: str) -> tuple[str, str]:
    source = f"oci://{reg.host}/{ref}"
    settings = RegistrySettings(docker_config=reg.docker_config)
    digest = asyncio.run(push(weights(tmp_path / "w"), source, settings=settings))
    return source, digest


def test_prewarm_with_credentials_reports_ready_labels_the_node_and_keeps_the_secret_out(tmp_path: Path) -> None:
    with start_registry(tmp_path / "reg", auth=True) as reg:
        source, digest = published(reg, tmp_path, "models/tiny:v1")
        assert reg.credentials is not None
        secret = {"data": {".dockerconfigjson": base64.b64encode(reg.docker_config.read_bytes()).decode()}}
        kube = Cluster({"regcred": secret})
        clock = Clock()
        agent = prewarmer(
            kube,
            tmp_path / "cache",
            clock,
            modelcache("private", source, credentials={"name": "regcred"}),
            modelcache("anonymous", source, nodeSelector={"pool": "a"}),
            modelcache("elsewhere", source, nodeSelector={"pool": "b"}),
        )

        async def run() -> None:
            await agent.round()
            # the first round announces every wanted source as Pending before any byte moves
            assert kube.status["private"][0]["phase"] in ("Pending", "Pulling", "Ready")
            await settle(agent)

        asyncio.run(run())
        (private,) = kube.status["private"]
        assert private["phase"] == "Ready" and private["digest"] == digest and private["node"] == NODE
        assert private["file"] == "tiny.gguf" and private["size"] == 3 * 1024 * 1024 + 123
        assert kube.labels[names.cache_label(digest)] == "ready"
        assert "elsewhere" not in kube.status, "a ModelCache for other nodes gets no entry from this one"
        assert {manager for _, manager in kube.applied} == {"wakegate-agent/n1"}
        assert reg.credentials.password not in json.dumps([body for body, _ in kube.applied])
        # the entry is leased while a ModelCache wants it: eviction cannot take it
        assert Cache(tmp_path / "cache").in_use(digest)
        assert not list(Path("/tmp").glob("wakegate-creds-*")), "the credentials file is gone after the pull"


def test_a_missing_tag_is_failed_with_its_reason_and_retried_later(tmp_path: Path) -> None:
    with start_registry(tmp_path / "reg") as reg:
        published(reg, tmp_path, "models/tiny:v1")
        kube = Cluster()
        clock = Clock()
        agent = prewarmer(kube, tmp_path / "cache", clock, modelcache("bad", f"oci://{reg.host}/models/tiny:nope"))
        asyncio.run(settle(agent))
        (entry,) = kube.status["bad"]
        assert entry["phase"] == "Failed" and entry["reason"] == "not_found" and "nope" in entry["message"]
        writes = len(kube.applied)
        asyncio.run(settle(agent))
        assert len(kube.applied) == writes, "nothing changed, nothing written; no retry before retry_seconds"
        clock.now += 31
        asyncio.run(settle(agent))
        assert kube.status["bad"][0]["reason"] == "not_found"


def test_a_missing_secret_is_failed_and_a_deleted_modelcache_gives_its_entries_up(tmp_path: Path) -> None:
    with start_registry(tmp_path / "reg") as reg:
        source, digest = published(reg, tmp_path, "models/tiny:v1")
        kube = Cluster()
        agent = prewarmer(
            kube,
            tmp_path / "cache",
            Clock(),
            modelcache("c", source, credentials={"name": "gone"}),
            modelcache("d", source),
        )
        asyncio.run(settle(agent))
        assert kube.status["c"][0]["reason"] == "bad_credentials"
        assert kube.status["c"][0]["message"] == "credentials Secret ns/gone does not exist"
        assert kube.status["d"][0]["phase"] == "Ready"
        agent.caches = Mirror()  # type: ignore[assignment]
        asyncio.run(settle(agent))
        assert kube.status["d"] == [] and kube.status["c"] == []
        assert not Cache(tmp_path / "cache").in_use(digest), "the lease went with the ModelCache"
        assert kube.labels[names.cache_label(digest)] == "ready", "the node still holds the entry"


def test_progress_is_reported_as_pulling_with_bytes(tmp_path: Path) -> None:
    size = 96 * 1024 * 1024
    with start_registry(tmp_path / "reg") as reg:
        source = f"oci://{reg.host}/models/big:v1"
        asyncio.run(push(weights(tmp_path / "w", size=size, name="big.gguf"), source))
        kube = Cluster()
        agent = prewarmer(kube, tmp_path / "cache", Clock(), modelcache("big", source))

        async def run() -> None:
            await agent.round()
            while kube.status["big"][0]["phase"] != "Ready":
                await asyncio.sleep(0.02)
                await agent.round()

        asyncio.run(run())
        seen = [body["status"]["nodes"][0] for body, _ in kube.applied]
        pulling = [e for e in seen if e["phase"] == "Pulling"]
        assert pulling and all(e["bytesTotal"] == size for e in pulling), seen
        done = [e["bytesDone"] for e in pulling]
        assert done == sorted(done), "bytes only grow"
        assert seen[-1]["phase"] == "Ready" and seen[-1]["size"] == size
