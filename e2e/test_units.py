"""Pure-Python pieces of the harness; no cluster needed (but run with the e2e suite)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from e2e import images, net
from e2e.containers import _mount_points, container_preexec, exit_reason
from e2e.nodeagent import IPPool

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    ("image", "recipe"),
    [
        ("ghcr.io/wakegate/sim:latest", images.sim),
        ("wakegate/sim:dev", images.sim),
        ("localhost:5000/wakegate/sim@sha256:abc", images.sim),
        ("wakegate/wakegate", images.wakegate),
        ("wakegate/e2e-exec:dev", images.exec_image),
        ("ghcr.io/other/wakegate-sim:1", None),
        # vLLM's images run as the cached CPU install (e2e/engines.py), whatever their tag.
        ("vllm/vllm-openai:v0.11", images.vllm_image),
        ("docker.io/library/nginx:1.27", None),
    ],
)
def test_image_lookup(image: str, recipe: images.Recipe | None) -> None:
    assert images.lookup(image) is recipe


def test_expand_follows_kubernetes_rules() -> None:
    env = {"A": "1"}
    assert images.expand("x$(A)y", env) == "x1y"
    assert images.expand("$(MISSING)", env) == "$(MISSING)"
    assert images.expand("$$(A)", env) == "$(A)"


@pytest.mark.parametrize(
    ("code", "expected"),
    [(0, (0, "Completed")), (3, (3, "Error")), (137, (137, "OOMKilled")), (-15, (143, "Error"))],
)
def test_exit_reason(code: int, expected: tuple[int, str]) -> None:
    assert exit_reason(code) == expected


def test_ip_pool_hands_out_each_address_once_until_returned() -> None:
    pool = IPPool("10.200.7.0/29", reserved=("10.200.7.1", "10.200.7.2", "10.200.7.3", "10.200.7.4"))
    a, b = pool.take(), pool.take()
    assert {a, b} == {"10.200.7.5", "10.200.7.6"}
    with pytest.raises(RuntimeError):
        pool.take()
    pool.give_back(a)
    assert pool.take() == a


def test_network_plan_gives_each_node_a_24_with_gateway_and_node_address() -> None:
    plan = net.plan("abc123", "10.201.0.0/16", 3)
    assert [(n.netns, n.cidr, n.gateway, n.address) for n in plan.nodes] == [
        ("wgabc123-0", "10.201.0.0/24", "10.201.0.1", "10.201.0.2"),
        ("wgabc123-1", "10.201.1.0/24", "10.201.1.1", "10.201.1.2"),
        ("wgabc123-2", "10.201.2.0/24", "10.201.2.1", "10.201.2.2"),
    ]
    assert all(len(n.netns) <= 15 for n in plan.nodes)  # also the root-side interface name
    assert net.ClusterNet.from_dict(plan.to_dict()) == plan
    with pytest.raises(net.NetError):
        net.plan("abc123", "127.1.0.0/16", 1)  # loopback: refused in EndpointSlices


def test_engine_images_run_the_built_engines_on_the_pods_ip_and_host_paths(tmp_path: Path) -> None:
    from e2e import engines, images

    recipe = images.lookup("ghcr.io/ggml-org/llama.cpp:server-cuda")
    assert recipe is images.llama_cpp_server
    ctx = images.ContainerContext(
        pod={"metadata": {"uid": "u1"}}, container={}, pod_ip="10.9.0.5", env={},
        command=["/app/llama-server"],
        args=["--model", "/models/local/tiny.gguf", "--host", "0.0.0.0", "--port", "8080"],
        mounts=[("/models/local", str(tmp_path))],
    )
    if not (engines.BIN_DIR / "llama-server").exists():
        with pytest.raises(ValueError, match=r"python -m e2e\.engines llama-server"):
            recipe(ctx)
        return
    argv = recipe(ctx)
    assert argv == [str(engines.BIN_DIR / "llama-server"), "--model", f"{tmp_path}/tiny.gguf",
                    "--host", "10.9.0.5", "--port", "8080"]
    ctx.command = ["/bin/sh", "-c"]
    with pytest.raises(ValueError, match="only llama-server runs here"):
        recipe(ctx)


def test_a_real_mounts_container_sees_its_hostpath_volumes_at_their_paths(tmp_path: Path) -> None:
    """vLLM is told adapter paths in the pod while it runs: its process gets the hostPath volumes
    bound at their mount paths in a mount namespace of its own, read-only where asked, and the
    host keeps no trace once it exits."""
    assert images.lookup("vllm/vllm-openai:latest") in images.REAL_MOUNTS
    host = tmp_path / "node-folder"
    host.mkdir()
    (host / "adapter.txt").write_text("weights\n")
    mount = tmp_path / "pod" / "models" / "adapters" / "abc"
    made = _mount_points([str(mount)])
    try:
        script = f"cat {mount}/adapter.txt; touch {mount}/new 2>/dev/null && echo writable || echo read-only"
        out = subprocess.run(["sh", "-c", script], preexec_fn=container_preexec(None, [(str(host), str(mount), True)]),
                             capture_output=True, text=True, timeout=30, check=True)
        assert out.stdout.split() == ["weights", "read-only"]
        assert list(mount.iterdir()) == []  # the bind was the child's alone
    finally:
        for folder in reversed(made):
            folder.rmdir()
    assert not (tmp_path / "pod").exists()
