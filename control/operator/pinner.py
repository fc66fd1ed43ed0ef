"""The operator's side of `oci://` tag pinning: the tag resolved once at the registry (with the
Model's and its runtime's imagePullSecrets), the pin kept in memory and in status (pinning.py
says what a pin is worth).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from wakegate.control.delivery.credentials import Credentials, DockerAuths
from wakegate.control.delivery.errors import DeliveryError
from wakegate.control.delivery.registry import RegistryClient, RegistrySettings
from wakegate.control.operator import pinning
from wakegate.control.operator import render as rnd
from wakegate.control.runtime_schema import InferenceRuntime
from wakegate.control.schema import Model

#: Seconds before a Model whose oci:// tag could not be resolved is tried again.
PIN_RETRY = 30.0

log = logging.getLogger("wakegate.operator")


class TagPinner:
    """The tag-pinning part of the `Reconciler` (controller.py, which holds the state)."""

    if TYPE_CHECKING:
        runtimes: dict[str, dict[str, Any]]
        registry_settings: RegistrySettings
        _pins: dict[str, tuple[str | None, str, str]]
        _pin_failures: dict[str, tuple[str | None, str, float, rnd.RenderError]]

        def poke(self, key: str) -> None: ...
        def _runtimes(self) -> list[InferenceRuntime]: ...
        async def _registry_auths(self, namespace: str, secret: str | None) -> DockerAuths: ...

    async def _pin(self, key: str, body: Mapping[str, Any], model: Model) -> str | None:
        """The Model's source pinned to a digest (`pinning`) when it names an oci:// tag: the pin
        already made for this `spec.source`, else the digest the registry gives for the tag now
        (with the Model's and runtime's imagePullSecrets). A registry that cannot answer is a
        render error with its reason, and the registry is asked again only `PIN_RETRY` seconds
        later (however many events come meanwhile); nothing is rendered from the tag until then."""
        source = model.spec.source
        tag = pinning.tag_source(source)
        if source is None or tag is None:
            return None
        uid = body["metadata"].get("uid")
        kept = self._pins.get(key)
        if kept is not None and kept[:2] == (uid, source):
            return kept[2]
        failed = self._pin_failures.get(key)
        if failed is not None and failed[:2] == (uid, source) and time.monotonic() < failed[2]:
            raise failed[3]
        pinned = pinning.recorded(source, body.get("status"))
        if pinned is None:
            refs = list(model.spec.imagePullSecrets)
            with contextlib.suppress(rnd.RenderError):  # the runtime's too, when there is one
                refs += rnd.select_runtime(model, self._runtimes()).spec.imagePullSecrets
            auths = await self._registry_auths_of(body["metadata"]["namespace"], [ref.name for ref in refs])
            try:
                async with RegistryClient(tag.registry, self.registry_settings, auths) as client:
                    digest, _, _ = await client.manifest(tag.repository, tag.reference)
            except DeliveryError as exc:
                error = rnd.RenderError(exc.reason, f"cannot resolve {source} to a digest: {exc}")
                self._pin_failures[key] = (uid, source, time.monotonic() + PIN_RETRY, error)
                asyncio.get_running_loop().call_later(PIN_RETRY, self.poke, key)
                raise error from None
            pinned = str(tag.at(digest))
            log.info("Model %s: %s pinned to %s", key, source, digest)
        self._pin_failures.pop(key, None)
        self._pins[key] = (uid, source, pinned)
        return pinned

    def _kept_pin(self, key: str, body: Mapping[str, Any]) -> str | None:
        """The pin status keeps while the Model cannot be rendered: the one of its current source."""
        source = (body.get("spec") or {}).get("source")
        kept = self._pins.get(key)
        if kept is not None and kept[:2] == (body["metadata"].get("uid"), source):
            return kept[2]
        return pinning.recorded(source, body.get("status")) if isinstance(source, str) else None

    async def _registry_auths_of(self, namespace: str, secrets: list[str]) -> DockerAuths:
        """Registry credentials from the named dockerconfigjson Secrets, the first naming a host
        winning (as the kubelet tries them); one that cannot be read is skipped with a warning that
        names it (the pull is then anonymous for its registries, as the kubelet's would be)."""
        by_host: dict[str, Credentials] = {}
        for name in dict.fromkeys(secrets):
            try:
                auths = await self._registry_auths(namespace, name)
            except ValueError as exc:
                log.warning("imagePullSecret skipped: %s", exc)
                continue
            for host, credentials in auths.by_host.items():
                by_host.setdefault(host, credentials)
        return DockerAuths(by_host)

