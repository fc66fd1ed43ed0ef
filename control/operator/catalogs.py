"""The operator's ModelCatalogs: when each is listed again, and its registry listed with the
credentials of its Secret.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from wakegate.control.delivery import catalog as cat
from wakegate.control.delivery.credentials import DockerAuths, parse_docker_config
from wakegate.control.delivery.listing import list_registry
from wakegate.control.delivery.registry import RegistrySettings
from wakegate.control.k8s.client import Kube, KubeError, path
from wakegate.control.k8s.objects import (
    modelcatalog_from_object,
    rfc3339_now,
)
from wakegate.control.operator.keys import CATALOG_KEY

log = logging.getLogger("wakegate.operator")


#: Docker config key of a `kubernetes.io/dockerconfigjson` Secret.
DOCKER_CONFIG_KEY = ".dockerconfigjson"
#: The longest the catalog timer sleeps between looks (a new catalog wakes it at once).
CATALOG_TICK = 30.0


def catalog_delay(body: Mapping[str, Any], now: float) -> float:
    """Seconds until a ModelCatalog is listed again, from what its status says was done last."""
    status = body.get("status") or {}
    meta = body.get("metadata") or {}
    refresh = int((body.get("spec") or {}).get("refreshSeconds") or 300)
    observed = status.get("observedGeneration")
    return cat.refresh_delay(
        refresh, cat.parse_time(status.get("lastRefreshTime")), int(meta.get("generation", 0)),
        int(observed) if observed is not None else None,
        (meta.get("annotations") or {}).get(cat.REFRESH_ANNOTATION), status.get("refreshToken"), now,
    )


def secret_auths(body: Mapping[str, Any], where: str) -> DockerAuths:
    """The Docker config of a `kubernetes.io/dockerconfigjson` Secret; a ValueError naming `where`
    (never the content) when it holds none."""
    encoded = (body.get("data") or {}).get(DOCKER_CONFIG_KEY)
    if not encoded:
        raise ValueError(f"{where} has no {DOCKER_CONFIG_KEY} key")
    try:
        text = base64.b64decode(encoded, validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise ValueError(f"{where}: {DOCKER_CONFIG_KEY} is not base64 text") from None
    auths = parse_docker_config(text, where)
    for line in auths.unsupported:
        log.warning("registry credentials: %s", line)
    return auths


class CatalogReconcile:
    """The ModelCatalog part of the `Reconciler` (controller.py, which holds the state)."""

    if TYPE_CHECKING:
        kube: Kube
        catalogs: dict[str, dict[str, Any]]
        registry_settings: RegistrySettings
        _listing: set[str]
        _catalog_wake: asyncio.Event

        def poke(self, key: str) -> None: ...
        async def _patch_status(self, kind: str, body: Mapping[str, Any], patch: Mapping[str, Any],
                                whole: Mapping[str, Any], current: Callable[[], dict[str, Any] | None]) -> None: ...

    async def _catalog_timer(self) -> None:
        """Queue every ModelCatalog whose refresh is due, then sleep until the next one is."""
        while True:
            self._catalog_wake.clear()
            delays = [CATALOG_TICK]
            for key, body in list(self.catalogs.items()):
                if key in self._listing:
                    continue
                delay = catalog_delay(body, time.time())
                if delay <= 0:
                    self._listing.add(key)
                    self.poke(CATALOG_KEY + key)
                else:
                    delays.append(delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._catalog_wake.wait(), timeout=min(delays))

    async def _refresh_catalog(self, key: str) -> None:
        """List a ModelCatalog's registry and write what it found (or why it could not) to status."""
        body = self.catalogs.get(key)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        meta = body["metadata"]
        namespace = meta["namespace"]
        token = (meta.get("annotations") or {}).get(cat.REFRESH_ANNOTATION)
        try:
            catalog = modelcatalog_from_object(body)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            result = cat.Refreshed((), (), ("InvalidSpec", problems))
        else:
            spec = catalog.spec
            try:
                auths = await self._registry_auths(namespace, spec.credentials.name if spec.credentials else None)
            except ValueError as exc:
                result = cat.Refreshed((), (), ("bad_credentials", str(exc)))
            else:
                settings = replace(self.registry_settings, plain_http=spec.plainHTTP)
                result = await list_registry(spec.registry, spec.repositories, settings, auths)
        previous = body.get("status") or {}
        status = cat.catalog_status(result, previous, rfc3339_now(), int(meta.get("generation", 0)), token)
        if result.failure is not None:
            log.warning("catalog %s: %s (%s)", key, result.failure[1], result.failure[0])
        await self._patch_status("ModelCatalog", body, status, status, lambda: self.catalogs.get(key))

    async def _registry_auths(self, namespace: str, secret: str | None) -> DockerAuths:
        """The credentials of a registry-credential Secret (a catalog's, a Model's imagePullSecret),
        kept in memory only (never on disk or in a log)."""
        if secret is None:
            return DockerAuths()
        try:
            body = await asyncio.to_thread(self.kube.get, path("v1", "Secret", namespace, secret))
        except KubeError as exc:
            why = "does not exist" if exc.status == 404 else f"cannot be read ({exc.status})"
            raise ValueError(f"credentials Secret {namespace}/{secret} {why}") from None
        return secret_auths(body, f"credentials Secret {namespace}/{secret}")

