"""Kopf as wakegate's two watchers use it (the operator, the xDS feeder): one registry, one way to run.

Kopf logs in with the credentials the seam finds (`api_client`'s lookup order), posts no
Kubernetes events, runs standalone (no peering: the operator elects its leader with a
Lease, feeders hold no state) and cluster-wide, and stops when the process's stop event is
set.
"""

from __future__ import annotations

import asyncio
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


async def run(handlers: kopf.OperatorRegistry, stop: asyncio.Event) -> None:
    settings = kopf.OperatorSettings()
    settings.posting.enabled = False
    await kopf.operator(registry=handlers, settings=settings, standalone=True, clusterwide=True, stop_flag=stop)
