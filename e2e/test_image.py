"""The project's image, built from the Dockerfile by podman (e2e/image.py) and run by it.

The first run builds the Debian base and the image (about 2 minutes); later runs reuse both while
their inputs' digest is unchanged. Needs root (rootful podman) and Debian's packages, which
e2e/image.py installs.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from e2e import image
from tests.support.waiting import wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="rootful podman: the e2e suite runs as root")


@pytest.fixture(scope="module")
def built() -> image.Built:
    return image.ensure_image()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def sim_container(built: image.Built) -> Iterator[tuple[str, int]]:
    name = f"wg-e2e-sim-{uuid.uuid4().hex[:8]}"
    port = _free_port()
    image.podman("run", "--detach", "--name", name, "--network=host", built.image,
                 "wakegate", "sim", "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny")
    try:
        yield name, port
    finally:
        image.podman("rm", "--force", "--time", "2", name, check=False)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def test_the_image_serves_the_sim_to_an_openai_client_as_a_non_root_user(sim_container: tuple[str, int]) -> None:
    name, port = sim_container
    wait_for(lambda: _answers(port), 60, f"the sim in container {name} to listen on {port}")
    with OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30) as client:
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello from the host"}], max_tokens=8,
        )

    assert reply.model == "tiny"
    assert reply.choices[0].message.content
    # The serving process, seen from the host: its real uid is the image's user, not root.
    pid = int(image.podman("inspect", "--format", "{{.State.Pid}}", name).stdout)
    uids = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("Uid:"))
    assert uids.split()[1:] == ["10001"] * 4
    assert "wakegate" in Path(f"/proc/{pid}/cmdline").read_bytes().decode().replace("\0", " ")


def test_the_envoy_target_runs_envoy_as_its_entrypoint(built: image.Built) -> None:
    out = image.podman("run", "--rm", "--network=none", "--user", "101", built.envoy, "--version")
    assert "envoy" in out.stdout and "1.40.0" in out.stdout, out.stdout

