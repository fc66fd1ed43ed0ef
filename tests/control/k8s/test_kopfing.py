"""Kopf inside the operator and the feeder: the process keeps its own signals and its own tasks.

Kopf runs here against an API server that is not there (its watches fail and retry); what is
checked is what Kopf does to the process around it, not what it watches. And against one that
asks to be called back later (a 429 with Retry-After), which Kopf must do when it says.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import time
from pathlib import Path

import kopf
import pytest
from aiohttp import web

from wakegate.control.k8s import kopfing
from wakegate.process import graceful_exit

KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:9"}}]
users: [{name: u, user: {token: not-a-real-token}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


async def started(kopf: asyncio.Task[None], signals: asyncio.Event) -> None:
    """Until Kopf has started (the signals were handed back); Kopf must not have stopped."""
    waiting = asyncio.create_task(signals.wait())
    await asyncio.wait({kopf, waiting}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    assert not kopf.done(), kopf.exception() if kopf.done() and not kopf.cancelled() else "cancelled"
    assert signals.is_set(), "Kopf did not start in 30 s"


async def test_sigterm_reaches_the_process_and_kopf_leaves_its_tasks_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = tmp_path / "kubeconfig"
    config.write_text(KUBECONFIG)
    stop, handed_back = asyncio.Event(), asyncio.Event()

    def signals() -> None:
        graceful_exit(stop, "test")
        handed_back.set()

    graceful_exit(stop, "test")
    kopf = asyncio.create_task(kopfing.run(kopfing.registry(str(config)), stop, signals=signals))
    try:
        await started(kopf, handed_back)
        # A task of the process's own, begun while Kopf runs (a server's stream, a worker).
        own = asyncio.create_task(asyncio.Event().wait())
        with caplog.at_level(logging.INFO, logger="wakegate"):
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(kopf, 30)
        # The process's handler got the signal (Kopf's would have stopped Kopf alone, unlogged).
        assert stop.is_set()
        assert "test: SIGTERM received, draining" in caplog.text
        # Kopf stopped without waiting for the process's task or cancelling it (it did both: 5 s,
        # then a cancel, on every stop of the operator and the feeder).
        assert not own.done()
        own.cancel()
    finally:
        stop.set()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().remove_signal_handler(sig)
        if not kopf.done():
            kopf.cancel()


class Initialising:
    """An apiserver (plain HTTP on loopback) whose ConfigMap storage answers 429 "storage is
    (re)initializing" with Retry-After: 1 to its first `refusals` requests, as a new CRD's does
    while its watch cache fills; then one ConfigMap is listed and watched."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        #: When each ConfigMap request came, and whether it was refused.
        self.requests: list[tuple[float, bool]] = []
        #: Ends the watches.
        self.closed = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if path == "/api":
            return web.json_response({"kind": "APIVersions", "versions": ["v1"]})
        if path == "/apis":
            crds = {"groupVersion": "apiextensions.k8s.io/v1", "version": "v1"}
            group = {"name": "apiextensions.k8s.io", "versions": [crds], "preferredVersion": crds}
            return web.json_response({"kind": "APIGroupList", "groups": [group]})
        if path == "/apis/apiextensions.k8s.io/v1":
            crds = {"name": "customresourcedefinitions", "singularName": "customresourcedefinition",
                    "namespaced": False, "kind": "CustomResourceDefinition", "verbs": ["list", "watch"]}  # fmt: skip
            return web.json_response({"kind": "APIResourceList", "groupVersion": "apiextensions.k8s.io/v1",
                                      "resources": [crds]})  # fmt: skip
        if path == "/apis/apiextensions.k8s.io/v1/customresourcedefinitions":
            return await self.listed(request, "CustomResourceDefinitionList", [])
        if path == "/api/v1":
            configmaps = {"name": "configmaps", "singularName": "configmap", "namespaced": True,
                          "kind": "ConfigMap", "verbs": ["get", "list", "watch"]}  # fmt: skip
            # Kopf waits to see namespaces served before it watches anything.
            namespaces = {"name": "namespaces", "singularName": "namespace", "namespaced": False,
                          "kind": "Namespace", "verbs": ["get", "list", "watch"]}  # fmt: skip
            return web.json_response(
                {"kind": "APIResourceList", "groupVersion": "v1", "resources": [configmaps, namespaces]}
            )
        if path != "/api/v1/configmaps":
            return web.json_response({"kind": "Status", "code": 404}, status=404)
        refused = sum(1 for _, r in self.requests if r) < self.refusals
        self.requests.append((time.monotonic(), refused))
        if refused:
            status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 429,
                      "reason": "TooManyRequests", "message": "storage is (re)initializing",
                      "details": {"retryAfterSeconds": 1}}  # fmt: skip
            return web.json_response(status, status=429, headers={"Retry-After": "1"})
        item = {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "one", "namespace": "default", "uid": "u1", "resourceVersion": "2"}}  # fmt: skip
        return await self.listed(request, "ConfigMapList", [item])

    async def listed(self, request: web.Request, kind: str, items: list[dict[str, object]]) -> web.StreamResponse:
        """`items` listed, or a watch with nothing new to say."""
        if request.query.get("watch") != "true":
            return web.json_response({"kind": kind, "metadata": {"resourceVersion": "2"}, "items": items})
        stream = web.StreamResponse(headers={"content-type": "application/json"})
        await stream.prepare(request)
        await self.closed.wait()
        return stream


async def test_a_watch_comes_back_when_the_apiserver_says_not_after_a_growing_backoff(tmp_path: Path) -> None:
    """Kopf's error backoff grows (1, 1, 2, 3, 5 s...); an apiserver's 429 names its own wait. A
    watch obeys the server: five refusals in a row cost about five seconds, not twelve."""
    server = Initialising(refusals=5)
    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    config = tmp_path / "kubeconfig"
    config.write_text(KUBECONFIG.replace("https://127.0.0.1:9", f"http://127.0.0.1:{port}"))
    registry = kopfing.registry(str(config))
    seen = asyncio.Event()

    async def event(body: kopf.Body, **_: object) -> None:
        if body["metadata"]["name"] == "one":
            seen.set()

    kopf.on.event("", "v1", "configmaps", registry=registry)(event)
    stop = asyncio.Event()
    task = asyncio.create_task(kopfing.run(registry, stop))
    try:
        await asyncio.wait_for(seen.wait(), 60)
    finally:
        stop.set()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().remove_signal_handler(sig)
        server.closed.set()
        await asyncio.wait_for(task, 30)
        await runner.cleanup()
    refused = [at for at, r in server.requests if r]
    assert len(refused) == 5 and not server.requests[5][1]
    gaps = [later - earlier for earlier, later in itertools.pairwise(at for at, _ in server.requests[:6])]
    # Each retry when the server said (1 s), never Kopf's 2, 3 and 5 s.
    assert all(0.9 <= gap < 1.9 for gap in gaps), gaps
