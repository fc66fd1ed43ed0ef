"""Kopf inside the operator and the feeder: the process keeps its own signals and its own tasks.

Kopf runs here against an API server that is not there (its watches fail and retry); what is
checked is what Kopf does to the process around it, not what it watches.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

import pytest

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
