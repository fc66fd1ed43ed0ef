"""Bytes that do not match their digest never reach the cache: a registry (or a proxy in front of
one) that serves same-size wrong bytes for a layer or for the config gets a digest-mismatch error,
the partial file is removed and no entry is written. The registry here is a few aiohttp handlers,
so that it can lie."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from wakegate.control.delivery import media
from wakegate.control.delivery.cache import FILES, Cache
from wakegate.control.delivery.digests import digest_of
from wakegate.control.delivery.errors import DeliveryError
from wakegate.control.delivery.registry import RegistrySettings
from wakegate.control.delivery.resolver import Access, resolve


def flipped(data: bytes) -> bytes:
    """`data` with one byte changed, same size."""
    return data[:-1] + bytes([data[-1] ^ 0xFF])


class LyingRegistry:
    """One model (`models/tiny:v1`: a config blob and a weight layer); `corrupt` names the blob
    whose bytes it alters ("config" or "layer"; "" for none)."""

    def __init__(self, corrupt: str) -> None:
        self.weights = os.urandom(3 * 1024 * 1024 + 17)
        self.config = json.dumps({"descriptor": {"name": "tiny"}}).encode()
        layer = {
            "mediaType": media.WEIGHT_RAW,
            "digest": digest_of(self.weights),
            "size": len(self.weights),
            "annotations": {media.ANNOTATION_TITLE: "tiny.gguf"},
        }
        config = {"mediaType": media.MODEL_CONFIG, "digest": digest_of(self.config), "size": len(self.config)}
        self.manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": media.OCI_MANIFEST,
                "artifactType": media.MODEL_ARTIFACT,
                "config": config,
                "layers": [layer],
            }
        ).encode()
        self.blobs = {
            digest_of(self.config): flipped(self.config) if corrupt == "config" else self.config,
            digest_of(self.weights): flipped(self.weights) if corrupt == "layer" else self.weights,
        }

    async def serve_manifest(self, request: web.Request) -> web.Response:
        return web.Response(body=self.manifest, headers={"Content-Type": media.OCI_MANIFEST})

    async def serve_blob(self, request: web.Request) -> web.Response:
        body = self.blobs.get(request.match_info["digest"])
        if body is None:
            return web.Response(status=404)
        return web.Response(body=body, headers={"Content-Type": "application/octet-stream"})


@pytest.fixture
async def registry(request: pytest.FixtureRequest) -> AsyncIterator[tuple[LyingRegistry, str]]:
    lying = LyingRegistry(request.param)
    app = web.Application()
    app.router.add_get("/v2/models/tiny/manifests/{reference}", lying.serve_manifest)
    app.router.add_get("/v2/models/tiny/blobs/{digest}", lying.serve_blob)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield lying, f"127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def access(tmp_path: Path) -> Access:
    config = tmp_path / "docker.json"
    config.write_text("{}")
    return Access(registry=RegistrySettings(docker_config=config, plain_http=True, retries=0))


@pytest.mark.parametrize("registry", ["layer", "config"], indirect=True)
async def test_wrong_bytes_of_the_right_size_are_a_digest_mismatch_and_nothing_is_cached(
    registry: tuple[LyingRegistry, str], tmp_path: Path
) -> None:
    lying, host = registry
    cache = Cache(tmp_path / "cache")
    with pytest.raises(DeliveryError) as failed:
        await resolve(f"oci://{host}/models/tiny:v1", cache, access=access(tmp_path))
    assert failed.value.reason == "digest_mismatch"
    key = digest_of(lying.manifest)
    assert cache.keys() == [] and cache.record(key) is None
    assert not (cache.staging_dir(key) / FILES / "tiny.gguf").exists()


@pytest.mark.parametrize("registry", [""], indirect=True)
async def test_the_same_registry_telling_the_truth_is_pulled(
    registry: tuple[LyingRegistry, str], tmp_path: Path
) -> None:
    lying, host = registry
    cache = Cache(tmp_path / "cache")
    resolved = await resolve(f"oci://{host}/models/tiny:v1", cache, access=access(tmp_path))
    try:
        assert resolved.model_path.read_bytes() == lying.weights
        assert cache.keys() == [digest_of(lying.manifest)]
    finally:
        resolved.release()
