"""`wakegate catalog` against the real Distribution registry (htpasswd auth): 150 repositories
through `_catalog` pages, tags through tag-list pages, the facts read from manifests and
ModelPack configs, credentials from a Docker config and in no output; `deploy` pins a tag."""

from __future__ import annotations

import asyncio
import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.tools.registry import Registry, start_registry
from tests.control.delivery.conftest import weights
from tests.support import REPO_ROOT
from wakegate.control.delivery import media
from wakegate.control.delivery.listing import Limits, list_registry
from wakegate.control.delivery.pushing import push
from wakegate.control.delivery.registry import RegistryClient, RegistrySettings
from wakegate.control.manifests import parse_models

pytestmark = pytest.mark.usefixtures("registry_bin")

REPOS = [f"models/m{i:03}" for i in range(150)]
MANY_TAGS = [f"v{i:02}" for i in range(25)]
WEIGHT = b"not really a gguf, but the registry never looks"
WEIGHT_DIGEST = "sha256:" + hashlib.sha256(WEIGHT).hexdigest()
CONFIG = json.dumps(
    {
        "descriptor": {"name": "tiny"},
        "config": {"format": "gguf", "architecture": "llama", "paramSize": "1.1B"},
        "modelfs": {"type": "layers", "diff_ids": [WEIGHT_DIGEST]},
    }
).encode()
CONFIG_DIGEST = "sha256:" + hashlib.sha256(CONFIG).hexdigest()


def publish(reg: Registry, repo: str, tags: list[str], quant: str, source: str | None) -> None:
    """A ModelPack artifact (config with format, architecture and parameters; one GGUF layer
    named for its quantization; the quantization also as a manifest annotation) under `tags`."""
    reg.upload_blob(repo, CONFIG_DIGEST, CONFIG, source)
    reg.upload_blob(repo, WEIGHT_DIGEST, WEIGHT, source)
    manifest = {
        "schemaVersion": 2,
        "mediaType": media.OCI_MANIFEST,
        "artifactType": media.MODEL_ARTIFACT,
        "config": {"mediaType": media.MODEL_CONFIG, "digest": CONFIG_DIGEST, "size": len(CONFIG)},
        "layers": [
            {
                "mediaType": media.WEIGHT_RAW,
                "digest": WEIGHT_DIGEST,
                "size": len(WEIGHT),
                "annotations": {media.ANNOTATION_TITLE: f"tiny-{quant}.gguf"},
            }
        ],
        "annotations": {"org.cncf.model.quantization": quant, "org.opencontainers.image.description": repo},
    }
    for tag in tags:
        resp = reg.request(
            "PUT",
            f"/v2/{repo}/manifests/{tag}",
            body=json.dumps(manifest).encode(),
            headers={"Content-Type": media.OCI_MANIFEST},
        )
        assert resp.status == 201, resp.body


@dataclass
class Published:
    reg: Registry
    """The htpasswd registry: own/tiny (pushed by `wakegate cache push`'s code) and tagged/many."""
    tiny: Path
    tiny_digest: str
    wide: Registry
    """An anonymous registry with the 150 repositories (bcrypt on every request would cost minutes)."""


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Published]:
    tmp = tmp_path_factory.mktemp("catalog")
    with start_registry(tmp / "reg", auth=True) as reg, start_registry(tmp / "wide") as wide:
        for i, repo in enumerate(REPOS):
            publish(wide, repo, ["v1"], f"Q{i % 8}_0", None if i == 0 else REPOS[0])
        publish(wide, "tagged/many", MANY_TAGS, "Q4_K_M", REPOS[0])
        publish(reg, "tagged/many", MANY_TAGS, "Q4_K_M", None)
        tiny = weights(tmp / "src", 64 * 1024)
        digest = asyncio.run(
            push(tiny, f"oci://{reg.host}/own/tiny:v1", settings=RegistrySettings(docker_config=reg.docker_config))
        )
        yield Published(reg, tiny, digest, wide)


def wakegate(*argv: str, config: Path) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(p for p in (str(REPO_ROOT / "proto"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "DOCKER_CONFIG": "/nonexistent"}
    command, action, *rest = argv
    return subprocess.run(
        [sys.executable, "-m", "wakegate", command, "--registry-config", str(config), action, *rest],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def deploy(reg: Registry, name: str, *flags: str, repo: str = "own/tiny:v1") -> subprocess.CompletedProcess[str]:
    """`wakegate catalog deploy <reg>/<repo> --as <name> <flags>` with the registry's credentials."""
    return wakegate("catalog", "deploy", f"{reg.host}/{repo}", "--as", name, *flags, config=reg.docker_config)


def test_the_client_pages_through_150_repositories_and_25_tags(published: Published) -> None:
    reg = published.wide

    async def listing() -> tuple[list[str], list[str]]:
        async with RegistryClient(reg.host, RegistrySettings(docker_config=reg.docker_config)) as client:
            return await client.repositories(), await client.tags("tagged/many", page=10)

    repositories, tags = asyncio.run(listing())
    # The registry answers 100 a page: a client that ignored `Link` would see two thirds.
    assert repositories == sorted([*REPOS, "tagged/many"])
    assert tags == MANY_TAGS

    async def capped() -> None:
        async with RegistryClient(reg.host, RegistrySettings(docker_config=reg.docker_config)) as client:
            await client.repositories(page=50, limit=120)

    with pytest.raises(Exception, match="more than 120 entries"):
        asyncio.run(capped())


def test_ls_lists_150_repositories_with_their_facts(published: Published) -> None:
    wide = published.wide
    out = wakegate("catalog", "ls", wide.host, "--json", config=wide.docker_config)
    assert out.returncode == 0, out.stderr
    entries = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(entries) == 150 + 25
    models = [e for e in entries if e["repository"].startswith("models/")]
    assert [e["repository"] for e in models] == REPOS
    for i, entry in enumerate(models):
        assert (entry["tag"], entry["format"], entry["architecture"], entry["parameters"], entry["quantization"]) == (
            "v1",
            "gguf",
            "llama",
            "1.1B",
            f"Q{i % 8}_0",
        )
        assert entry["size"] == len(WEIGHT)
        assert entry["annotations"]["org.opencontainers.image.description"] == entry["repository"]
        assert entry["artifactType"] == media.MODEL_ARTIFACT
    assert [e["tag"] for e in entries if e["repository"] == "tagged/many"] == MANY_TAGS


def test_ls_with_credentials_shows_the_facts_and_no_password(published: Published) -> None:
    reg = published.reg
    assert reg.credentials is not None
    out = wakegate("catalog", "ls", reg.host, "--json", config=reg.docker_config)
    assert out.returncode == 0, out.stderr
    entries = [json.loads(line) for line in out.stdout.splitlines()]
    own = next(e for e in entries if e["repository"] == "own/tiny")
    assert own["digest"] == published.tiny_digest and own["format"] == "gguf"
    assert own["size"] == published.tiny.stat().st_size
    assert own["source"] == f"oci://{reg.host}/own/tiny:v1@{published.tiny_digest}"
    assert [e["tag"] for e in entries if e["repository"] == "tagged/many"] == MANY_TAGS
    assert reg.credentials.password not in out.stdout + out.stderr

    table = wakegate("catalog", "ls", f"{reg.host}/tagged", "--page", "7", config=reg.docker_config)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["REPOSITORY", "TAG", "DIGEST", "SIZE", "FORMAT", "ARCH", "PARAMS", "QUANT"]
    assert [line.split()[1] for line in lines[1:-1]] == MANY_TAGS
    assert lines[1].split()[-4:] == ["gguf", "llama", "1.1B", "Q4_K_M"]
    assert lines[-1] == f"25 tags in 1 repositories on {reg.host}"
    assert reg.credentials.password not in table.stdout + table.stderr


def test_without_credentials_ls_fails_in_one_line(published: Published) -> None:
    reg = published.reg
    out = wakegate("catalog", "ls", reg.host, config=reg.anonymous_config)
    assert out.returncode == 1
    assert out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and "credentials" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_prefix_limits_the_listing_to_whole_path_segments(published: Published) -> None:
    wide = published.wide
    result = asyncio.run(list_registry(wide.host, ["models/m14"], limits=Limits(page=30)))
    assert result.failure is None and result.errors == ()
    assert [e.repository for e in result.entries] == []  # `models/m14` is not a prefix of `models/m140`
    result = asyncio.run(list_registry(wide.host, ["models/m140", "tagged"]))
    assert sorted({e.repository for e in result.entries}) == ["models/m140", "tagged/many"]


def test_deploy_writes_a_model_pinned_by_digest(published: Published, tmp_path: Path) -> None:
    reg = published.reg
    target = tmp_path / "tiny.yaml"
    out = deploy(reg, "tiny", "--min", "1", "-o", str(target))
    assert out.returncode == 0, out.stderr
    (model,) = parse_models(target.read_text(), str(target))
    assert model.metadata.name == "tiny"
    assert model.spec.source == f"oci://{reg.host}/own/tiny:v1@{published.tiny_digest}"
    assert model.spec.scaling.min == 1 and model.spec.backend == "llamacpp"

    missing = deploy(reg, "x", repo="own/nothing:v1")
    assert missing.returncode == 1 and "not_found" not in missing.stdout
    assert len(missing.stderr.strip().splitlines()) == 1

    bad = deploy(reg, "Not_A_Name")
    assert bad.returncode == 2 and "--as" in bad.stderr


class _ApiServer(http.server.BaseHTTPRequestHandler):
    """A recording stand-in for the API server: answers every PATCH with the object it got."""

    seen: list[tuple[str, str, str, dict[str, Any]]] = []

    def do_PATCH(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append(("PATCH", self.path, self.headers["Content-Type"], body))
        answer = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: Any) -> None:
        pass


def test_deploy_apply_creates_the_model_on_the_cluster(published: Published, tmp_path: Path) -> None:
    reg = published.reg
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ApiServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "stand-in",
                    "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}],
                    "users": [{"name": "u", "user": {"token": "t"}}],
                    "contexts": [{"name": "stand-in", "context": {"cluster": "c", "user": "u"}}],
                }
            )
        )
        out = deploy(reg, "tiny", "--apply", "-n", "team-a", "--kubeconfig", str(kubeconfig))
        assert out.returncode == 0, out.stderr
        ((method, path, content_type, body),) = _ApiServer.seen
        assert (method, content_type) == ("PATCH", "application/apply-patch+yaml")
        assert path.startswith("/apis/wakegate.io/v1alpha1/namespaces/team-a/models/tiny?")
        assert "fieldManager=wakegate-catalog" in path
        assert body["spec"]["source"] == f"oci://{reg.host}/own/tiny:v1@{published.tiny_digest}"
        assert body["metadata"] == {"name": "tiny", "namespace": "team-a"}

        _ApiServer.seen.clear()
        adapter = deploy(
            reg, "tiny-sql", "--adapter-of", "tiny", "--apply", "-n", "team-a", "--kubeconfig", str(kubeconfig)
        )
        assert adapter.returncode == 0, adapter.stderr
        assert "applied LoRAAdapter team-a/tiny-sql" in adapter.stderr
        ((method, path, content_type, body),) = _ApiServer.seen
        assert (method, content_type) == ("PATCH", "application/apply-patch+yaml")
        assert path.startswith("/apis/wakegate.io/v1alpha1/namespaces/team-a/loraadapters/tiny-sql?")
        assert "fieldManager=wakegate-catalog" in path
        assert body["kind"] == "LoRAAdapter" and body["metadata"] == {"name": "tiny-sql", "namespace": "team-a"}
        assert body["spec"] == {
            "baseModel": "tiny",
            "servedName": "tiny-sql",
            "source": f"oci://{reg.host}/own/tiny:v1@{published.tiny_digest}",
        }
    finally:
        server.shutdown()
        server.server_close()

    nowhere = deploy(reg, "tiny", "--apply", "--kubeconfig", str(tmp_path / "missing"))
    assert nowhere.returncode == 1 and "no cluster to apply to" in nowhere.stderr
    assert "Traceback" not in nowhere.stderr


def test_deploy_writes_a_lora_adapter_for_an_adapter_artifact(published: Published) -> None:
    reg = published.reg
    out = deploy(reg, "tiny-sql", "--adapter-of", "tiny")
    assert out.returncode == 0, out.stderr
    (doc,) = yaml.safe_load_all(out.stdout)
    assert (doc["kind"], doc["metadata"]["name"]) == ("LoRAAdapter", "tiny-sql")
    assert doc["spec"] == {
        "baseModel": "tiny",
        "servedName": "tiny-sql",
        "source": f"oci://{reg.host}/own/tiny:v1@{published.tiny_digest}",
    }
