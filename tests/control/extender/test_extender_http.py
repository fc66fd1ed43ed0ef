"""The extender over real HTTP (aiohttp test server), with in-memory node and bench sources."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.support.scheduler import node, pod
from wakegate.control.extender import server as extender_server
from wakegate.control.extender.server import make_app
from wakegate.control.placement.benchdata import result_key
from wakegate.control.placement.rules import Weights


class Sources:
    def __init__(self, nodes: list[dict[str, Any]], tps: dict[str, float]) -> None:
        self.nodes = {n["metadata"]["name"]: n for n in nodes}
        self.tps = tps

    def node(self, name: str) -> Mapping[str, Any] | None:
        return self.nodes.get(name)

    def throughput(self, key: str) -> float | None:
        return self.tps.get(key)

    def ready(self) -> bool:
        return True


NODES = [
    node("fast", arch="sm90"),
    node("slow", arch="sm80"),
    node("full", arch="sm90", free=1000),
    node("bare", vendor=None, arch=None, count=None, vram=None, free=None),
]
TPS = {
    result_key("vllm", "m1", "nvidia-sm90"): 500.0,
    result_key("vllm", "m1", "nvidia-sm80"): 100.0,
}


@pytest.fixture
async def client() -> AsyncIterator[TestClient[Any, Any]]:
    app = make_app(Sources(NODES, TPS), Weights(), max_body=64 * 1024)
    async with TestClient(TestServer(app)) as c:
        yield c


async def post(client: TestClient[Any, Any], path: str, body: object) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = await client.post(path, data=data, headers={"Content-Type": "application/json"})
    return resp.status, await resp.json()


async def test_filter_by_node_names(client: TestClient[Any, Any]) -> None:
    status, result = await post(
        client, "/filter", {"Pod": pod(), "Nodes": None, "NodeNames": ["fast", "slow", "full", "bare", "ghost"]}
    )
    assert status == 200
    assert result["NodeNames"] == ["fast", "slow"]
    assert result["Nodes"] is None
    assert result["Error"] == ""
    assert result["FailedNodes"] == {
        "full": "free VRAM 1000 MiB < 20000 MiB needed (1 GPU x 20000 MiB)",
        "ghost": "node not (yet) in the wakegate extender's node cache",
    }
    assert set(result["FailedAndUnresolvableNodes"]) == {"bare"}
    assert "wakegate.io/gpu.vendor" in result["FailedAndUnresolvableNodes"]["bare"]


async def test_filter_with_full_node_objects_echoes_the_passing_ones(client: TestClient[Any, Any]) -> None:
    status, result = await post(client, "/filter", {"Pod": pod(backend="vllm-omni"), "Nodes": {"items": NODES}})
    assert status == 200
    assert result["NodeNames"] is None
    assert [n["metadata"]["name"] for n in result["Nodes"]["items"]] == ["fast"]
    assert result["Nodes"]["items"][0] == NODES[0]
    assert result["FailedAndUnresolvableNodes"]["slow"] == "backend vllm-omni does not support GPU arch sm80"


async def test_pod_without_gpus_passes_everything(client: TestClient[Any, Any]) -> None:
    _, result = await post(client, "/filter", {"Pod": pod(gpus=0), "NodeNames": ["bare", "ghost"]})
    assert result["NodeNames"] == ["bare", "ghost"]


async def test_score_prefers_the_faster_device_class(client: TestClient[Any, Any]) -> None:
    status, result = await post(client, "/score", {"Pod": pod(), "NodeNames": ["fast", "slow"]})
    assert status == 200
    assert result == [{"Host": "fast", "Score": 10}, {"Host": "slow", "Score": 0}]


async def test_score_with_node_objects_and_unknown_nodes(client: TestClient[Any, Any]) -> None:
    _, result = await post(client, "/score", {"Pod": pod(), "Nodes": {"items": [NODES[0]]}, "NodeNames": None})
    assert result == [{"Host": "fast", "Score": 10}]
    _, result = await post(client, "/score", {"Pod": pod(), "NodeNames": ["ghost", "bare"]})
    assert result == [{"Host": "ghost", "Score": 10}, {"Host": "bare", "Score": 10}]


async def test_empty_candidates(client: TestClient[Any, Any]) -> None:
    _, result = await post(client, "/filter", {"Pod": pod(), "Nodes": None, "NodeNames": None})
    assert result["NodeNames"] == []
    _, result = await post(client, "/score", {"Pod": pod(), "NodeNames": []})
    assert result == []


@pytest.mark.parametrize("path", ["/filter", "/score"])
@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[" * 20000 + b"]" * 20000, "not JSON"),
        (b"[]", "must be a JSON object"),
        (b"{}", "Pod must be an object"),
        (b'{"Pod": null}', "Pod must be an object"),
        (b'{"Pod": {}, "NodeNames": "fast"}', "NodeNames must be a list of strings"),
        (b'{"Pod": {}, "NodeNames": [1]}', "NodeNames must be a list of strings"),
        (b'{"Pod": {}, "Nodes": {"items": [{"metadata": {}}]}}', "Nodes.items must be a list"),
        (b'{"Pod": {}, "Nodes": 3}', "Nodes.items must be a list"),
    ],
)
async def test_malformed_requests_are_400_with_a_message(
    client: TestClient[Any, Any], path: str, body: bytes, message: str
) -> None:
    status, result = await post(client, path, body)
    assert status == 400
    assert message in result["error"]


@pytest.mark.parametrize("path", ["/filter", "/score"])
async def test_oversized_body_is_400(client: TestClient[Any, Any], path: str) -> None:
    big = {"Pod": pod(), "NodeNames": ["n" * 100] * 1000}
    status, result = await post(client, path, big)
    assert status == 400
    assert "larger than 65536 bytes" in result["error"]


async def test_nan_literals_in_annotations_do_not_break_scoring(client: TestClient[Any, Any]) -> None:
    body = b'{"Pod": %s, "Nodes": {"items": [%s]}}' % (
        json.dumps(pod()).encode(),
        json.dumps(node("weird", free="NaN", util="inf", vram="-1")).encode(),
    )
    status, result = await post(client, "/score", body)
    assert status == 200 and result == [{"Host": "weird", "Score": 10}]
    status, result = await post(client, "/filter", body)
    assert status == 200 and "free VRAM unknown" in result["FailedAndUnresolvableNodes"]["weird"]


async def test_internal_errors_are_protocol_answers_not_500(
    client: TestClient[Any, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def boom(*_args: object, **_kw: object) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(extender_server, "filter_node", boom)
    monkeypatch.setattr(extender_server, "raw_score", boom)
    status, result = await post(client, "/filter", {"Pod": pod(), "NodeNames": ["fast"]})
    assert status == 200 and "RuntimeError('bug')" in result["Error"]
    status, result = await post(client, "/score", {"Pod": pod(), "NodeNames": ["fast"]})
    assert status == 200 and result == []


async def test_health_endpoints(client: TestClient[Any, Any]) -> None:
    assert (await client.get("/healthz")).status == 200
    assert (await client.get("/readyz")).status == 200
