"""The real Distribution registry (e2e/tools/registry.py) with the real ORAS CLI: what the model
delivery tests build on works as they will use it."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import ssl
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from e2e.tools.registry import Registry, start_registry

ARTIFACT_TYPE = "application/vnd.wakegate.test.model.v1"
LAYER_TYPE = "application/vnd.wakegate.test.gguf.v1"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
EMPTY_TYPE = "application/vnd.oci.empty.v1+json"
EMPTY = b"{}"
EMPTY_DIGEST = "sha256:" + hashlib.sha256(EMPTY).hexdigest()

pytestmark = pytest.mark.usefixtures("registry_bin", "oras_bin")


def weights(tmp: Path, size: int = 3 * 1024 * 1024) -> Path:
    path = tmp / "tiny.gguf"
    path.write_bytes(os.urandom(size))
    return path


def push(reg: Registry, ref: str, file: Path) -> None:
    out = reg.oras("push", ref, "--artifact-type", ARTIFACT_TYPE, f"{file.name}:{LAYER_TYPE}", cwd=file.parent)
    assert out.returncode == 0, out.stdout + out.stderr


def pull(reg: Registry, ref: str, into: Path, anonymous: bool = False) -> tuple[int, str]:
    out = reg.oras("pull", ref, "--output", str(into), anonymous=anonymous)
    return out.returncode, out.stdout + out.stderr


def test_registry_answers_then_stops_cleanly(tmp_path: Path) -> None:
    with start_registry(tmp_path) as reg:
        resp = reg.request("GET", "/v2/")
        assert resp.status == 200
        assert resp.headers["Docker-Distribution-Api-Version"] == "registry/2.0"
        assert reg.storage.is_relative_to(tmp_path)
        host, port = reg.host.rsplit(":", 1)
        assert host == "127.0.0.1"
    with pytest.raises(ProcessLookupError):
        os.kill(reg.pid, 0)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=2).close()
    # SIGTERM took the draining path, not a kill.
    assert "stopping server gracefully" in reg.log.read_text()


def test_oras_push_then_pull_gets_the_same_bytes(tmp_path: Path) -> None:
    file = weights(tmp_path)
    with start_registry(tmp_path / "reg") as reg:
        ref = f"{reg.host}/models/tiny:v1"
        push(reg, ref, file)

        manifest = reg.request("GET", "/v2/models/tiny/manifests/v1", headers={"Accept": OCI_MANIFEST})
        assert manifest.status == 200, manifest.body
        body = manifest.json()
        assert body["artifactType"] == ARTIFACT_TYPE
        [layer] = body["layers"]
        assert layer["mediaType"] == LAYER_TYPE
        assert layer["annotations"]["org.opencontainers.image.title"] == "tiny.gguf"
        assert layer["digest"] == "sha256:" + hashlib.sha256(file.read_bytes()).hexdigest()
        assert layer["size"] == file.stat().st_size

        code, out = pull(reg, ref, tmp_path / "out")
        assert code == 0, out
        assert (tmp_path / "out" / "tiny.gguf").read_bytes() == file.read_bytes()


def test_htpasswd_refuses_anonymous_and_serves_the_user(tmp_path: Path) -> None:
    file = weights(tmp_path)
    with start_registry(tmp_path / "reg", auth=True) as reg:
        assert reg.credentials is not None
        anonymous = reg.request("GET", "/v2/", anonymous=True)
        assert anonymous.status == 401
        assert anonymous.headers["WWW-Authenticate"] == 'Basic realm="wakegate-tests"'
        wrong = reg.request("GET", "/v2/", anonymous=True, headers={"Authorization": "Basic d2FrZWdhdGU6bm9wZQ=="})
        assert wrong.status == 401

        ref = f"{reg.host}/models/tiny:v1"
        push(reg, ref, file)
        assert reg.request("GET", "/v2/models/tiny/manifests/v1", anonymous=True).status == 401
        code, out = pull(reg, ref, tmp_path / "anon", anonymous=True)
        assert code != 0
        assert "credential" in out, out
        assert not (tmp_path / "anon" / "tiny.gguf").exists()

        code, out = pull(reg, ref, tmp_path / "user")
        assert code == 0, out
        assert (tmp_path / "user" / "tiny.gguf").read_bytes() == file.read_bytes()
        # The password reaches oras through the Docker config, never its command line or log.
        assert reg.credentials.password not in out
        assert reg.credentials.password not in reg.log.read_text()


def test_tls_with_a_throwaway_ca(tmp_path: Path) -> None:
    file = weights(tmp_path, size=64 * 1024)
    with start_registry(tmp_path / "reg", tls=True, auth=True) as reg:
        assert reg.url.startswith("https://") and reg.ca is not None
        assert reg.request("GET", "/v2/").status == 200
        # The certificate chains only to the throwaway CA, not to the system's roots.
        plain = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with pytest.raises(urllib.error.URLError) as failure:
            plain.open(reg.url + "/v2/", timeout=5)
        assert isinstance(failure.value.reason, ssl.SSLCertVerificationError)

        ref = f"{reg.host}/models/tiny:v1"
        push(reg, ref, file)
        code, out = pull(reg, ref, tmp_path / "out")
        assert code == 0, out
        assert (tmp_path / "out" / "tiny.gguf").read_bytes() == file.read_bytes()


def put_manifest(reg: Registry, repo: str, source: str | None) -> None:
    """A minimal OCI artifact in `repo`; its one blob is mounted from `source` once that holds it."""
    reg.upload_blob(repo, EMPTY_DIGEST, EMPTY, source)
    empty = {"mediaType": EMPTY_TYPE, "digest": EMPTY_DIGEST, "size": len(EMPTY)}
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": ARTIFACT_TYPE,
        "config": empty,
        "layers": [empty],
    }
    resp = reg.request(
        "PUT", f"/v2/{repo}/manifests/v1", body=json.dumps(manifest).encode(), headers={"Content-Type": OCI_MANIFEST}
    )
    assert resp.status == 201, resp.body


def test_catalog_pages_past_100_repositories(tmp_path: Path) -> None:
    repos = [f"models/m{i:03}" for i in range(150)]
    with start_registry(tmp_path) as reg:
        for repo in repos:
            put_manifest(reg, repo, None if repo == repos[0] else repos[0])

        pages: list[list[str]] = []
        path: str | None = "/v2/_catalog"
        while path is not None:
            resp = reg.request("GET", path)
            assert resp.status == 200, resp.body
            pages.append(resp.json()["repositories"])
            link = re.fullmatch(r'<([^>]+)>; rel="next"', resp.headers.get("Link", ""))
            path = link[1] if link else None
        # The registry's default page is 100 entries: a client that ignores Link sees two thirds.
        assert [len(page) for page in pages] == [100, 50]
        assert [repo for page in pages for repo in page] == repos

        listed = reg.oras("repo", "ls", reg.host)
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout.split() == repos
