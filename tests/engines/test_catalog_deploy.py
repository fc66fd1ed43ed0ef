"""`wakegate catalog deploy` writes a Model that serves: the generated GGUF pushed to the real
registry (htpasswd) with `wakegate cache push`'s code, listed, deployed as a manifest pinned
by digest, and run by `wakegate up` with the real llama-server, which answers a completion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.tools.registry import start_registry
from tests.engines.conftest import TinyFiles
from tests.engines.test_up_engines import engines_path
from tests.engines.test_up_oci import chat, publish
from tests.support import REPO_ROOT
from tests.support.tools import registry_bin
from tests.support.up import UpProcess
from wakegate.control.manifests import parse_models

__all__ = ["registry_bin"]
pytestmark = pytest.mark.usefixtures("registry_bin")


def catalog(*argv: str, config: Path) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(p for p in (str(REPO_ROOT / "proto"), os.environ.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "wakegate", "catalog", "--registry-config", str(config), *argv]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": path, "DOCKER_CONFIG": "/nonexistent"},
    )


def test_a_deployed_catalog_entry_serves_a_completion(tmp_path: Path, tiny: TinyFiles, llama_server_bin: Path) -> None:
    with start_registry(tmp_path / "reg", auth=True) as reg:
        assert reg.credentials is not None
        digest = publish(reg, tiny.model, f"oci://{reg.host}/models/tiny:v1")
        listed = catalog("ls", f"{reg.host}/models", "--json", config=reg.docker_config)
        assert listed.returncode == 0, listed.stderr
        (entry,) = [json.loads(line) for line in listed.stdout.splitlines()]
        assert (entry["repository"], entry["tag"], entry["digest"], entry["format"]) == (
            "models/tiny",
            "v1",
            digest,
            "gguf",
        )

        manifest = tmp_path / "tiny.yaml"
        deployed = catalog(
            "deploy", f"{reg.host}/models/tiny:v1", "--as", "tiny", "-o", str(manifest), config=reg.docker_config
        )
        assert deployed.returncode == 0, deployed.stderr
        text = manifest.read_text()
        (model,) = parse_models(text, str(manifest))
        assert model.spec.source == f"oci://{reg.host}/models/tiny:v1@{digest}" == entry["source"]
        assert model.spec.scaling.min == 0

        # `up` reads the credentials from the same Docker config, through $DOCKER_CONFIG.
        docker_dir = tmp_path / "docker"
        docker_dir.mkdir()
        (docker_dir / "config.json").write_text(reg.docker_config.read_text())
        up = UpProcess(
            tmp_path,
            text,
            "--cache-dir",
            str(tmp_path / "cache"),
            env={**engines_path(llama_server_bin), "DOCKER_CONFIG": str(docker_dir)},
        )
        try:
            up.wait_ready({"tiny": 0}, timeout=60)
            resp = chat(up, "tiny", timeout=120)
            assert resp.status == 200, resp.body
            body = resp.json()
            assert body["model"] == "tiny"
            assert body["choices"][0]["message"]["content"]
            assert reg.credentials.password not in up.log()
        finally:
            assert up.stop() == 0, up.log()
        assert reg.credentials.password not in listed.stdout + listed.stderr + deployed.stdout + deployed.stderr
