"""Kopf as wakegate's two watchers use it (the operator, the xDS feeder): one registry, one way to run.

Kopf logs in with the credentials the seam finds (`api_client`'s lookup order), posts no
Kubernetes events, runs standalone (no peering: the operator elects its leader with a
Lease, feeders hold no state) and cluster-wide, and stops when the process's stop event is
set.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Collection, Iterator
from typing import Any

import kopf

from wakegate.control.k8s.client import api_client, connection_info


def registry(kubeconfig: str | None) -> kopf.OperatorRegistry:
    """A registry whose login uses the seam's credentials; handlers are added by the caller."""
    handlers = kopf.OperatorRegistry()

    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(**connection_info(api_client(kubeconfig).configuration))

    kopf.on.login(registry=handlers)(login)
    return handlers


async def run(
    handlers: kopf.OperatorRegistry, stop: asyncio.Event, signals: Callable[[], None] = lambda: None
) -> None:
    """Run Kopf until `stop` is set.

    `signals` puts the process's own SIGTERM/SIGINT handlers back. Kopf takes both signals for
    itself when it starts on the main thread, and on a signal it stops itself first. The process
    would then shut down in Kopf's order rather than its own, without its log line.

    On its way out Kopf waits up to 5 s for every task created after it started, then cancels
    them. The process's own tasks (servers, streams, workers, the Lease) never end on their own,
    so it waited the full 5 s on each stop, and a supervisor's grace was spent before the Lease
    was released. Kopf is told to leave alone every task whose coroutine is not its own code.
    """
    settings = kopf.OperatorSettings()
    settings.posting.enabled = False
    # An apiserver that answers 429 names when to come back (1 s while a new CRD's storage
    # initialises): come back then, not after Kopf's growing error backoff (1, 1, 2, 3, 5, 8 s...),
    # which kept a watch away, and a feeder from serving, for tens of seconds after the apiserver
    # was ready.
    settings.networking.enforce_retry_after = True
    tasks = await kopf.spawn_tasks(
        registry=handlers, settings=settings, standalone=True, clusterwide=True, stop_flag=stop
    )
    signals()
    await kopf.run_tasks(tasks, ignored=_NotKopfs())


#: Kopf's package folder as its modules' code objects name it (the path they were loaded from).
_KOPF_DIR = os.path.join(os.path.dirname(kopf.__file__), "")


def _kopfs(task: asyncio.Task[Any]) -> bool:
    """Whether `task` runs Kopf's own code (its watchers, workers and guards do)."""
    code = getattr(task.get_coro(), "cr_code", None)
    return code is not None and code.co_filename.startswith(_KOPF_DIR)


class _NotKopfs(Collection[asyncio.Task[Any]]):
    """The tasks Kopf must not wait for or cancel when it stops: all but its own. Kopf asks only
    `task in ignored`."""

    def __contains__(self, task: object) -> bool:
        return not (isinstance(task, asyncio.Task) and _kopfs(task))

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(())

    def __len__(self) -> int:
        return 0
