"""Leader election on a `coordination.k8s.io/v1` Lease, as client-go's leaderelection does it.

One holder at a time: the holder renews `renewTime` every `renew_seconds`; a
candidate takes the Lease over once it has seen the same record unchanged for
`lease_seconds` (measured on its own clock, so clock skew between machines does
not matter). Writes use the Lease's resourceVersion, so two candidates racing
for an expired Lease cannot both win. Used by `wakegate operator` and reusable
by any component that must run once per cluster (the builtin scaler).

A Lease cannot be created in a namespace that does not exist: the first attempt raises
:class:`LeaseNamespaceMissing` and :meth:`LeaderLease.acquire` gives up at once instead of
retrying forever (the namespace will not appear by itself; docs/decisions.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from wakegate.control.k8s.client import Kube, KubeError, path

log = logging.getLogger("wakegate.lease")


def _now_micro() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseNamespaceMissing(KubeError):
    """The Lease's namespace does not exist (the API server answered 404 to creating the Lease)."""

    def __init__(self, namespace: str, cause: KubeError) -> None:
        super().__init__(cause.status, "NotFound", cause.message)
        self.namespace = namespace


@dataclass
class LeaseConfig:
    namespace: str
    name: str
    identity: str
    lease_seconds: float = 15.0
    renew_seconds: float = 5.0


class LeaderLease:
    """Acquire, renew and release one Lease for `identity`."""

    def __init__(self, kube: Kube, cfg: LeaseConfig) -> None:
        self.kube = kube
        self.cfg = cfg
        self._observed: tuple[str, str] | None = None
        self._observed_at = 0.0
        self._last_renew = 0.0

    @property
    def _path(self) -> str:
        return path("coordination.k8s.io/v1", "Lease", self.cfg.namespace, self.cfg.name)

    def _body(self, transitions: int, acquire_time: str | None) -> dict[str, Any]:
        now = _now_micro()
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.cfg.name, "namespace": self.cfg.namespace},
            "spec": {
                "holderIdentity": self.cfg.identity,
                "leaseDurationSeconds": max(1, round(self.cfg.lease_seconds)),
                "acquireTime": acquire_time or now,
                "renewTime": now,
                "leaseTransitions": transitions,
            },
        }

    def try_acquire_or_renew(self) -> bool:
        """One attempt (blocking I/O); True while this identity holds the Lease."""
        current = self.kube.get_or_none(self._path)
        if current is None:
            body = self._body(0, None)
            try:
                self.kube.request("POST", path("coordination.k8s.io/v1", "Lease", self.cfg.namespace), body)
            except KubeError as exc:
                if exc.status == 409:
                    return False
                if exc.status == 404:  # the collection itself is missing: no such namespace
                    raise LeaseNamespaceMissing(self.cfg.namespace, exc) from None
                raise
            self._last_renew = time.monotonic()
            return True
        spec = current.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        record = (holder, str(spec.get("renewTime")))
        now = time.monotonic()
        if record != self._observed:
            self._observed, self._observed_at = record, now
        duration = float(spec.get("leaseDurationSeconds") or self.cfg.lease_seconds)
        mine = holder == self.cfg.identity
        if not mine and holder and now < self._observed_at + duration:
            return False
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if mine else 1)
        body = self._body(transitions, spec.get("acquireTime") if mine else None)
        body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        try:
            self.kube.request("PUT", self._path, body)
        except KubeError as exc:
            if exc.status == 409:
                return False
            raise
        if not mine:
            log.info("lease %s/%s taken over from %r", self.cfg.namespace, self.cfg.name, holder)
        self._last_renew = time.monotonic()
        return True

    async def acquire(self) -> None:
        """Block until this identity holds the Lease; raises :class:`LeaseNamespaceMissing` at once."""
        while True:
            try:
                if await asyncio.to_thread(self.try_acquire_or_renew):
                    log.info("lease %s/%s acquired by %s", self.cfg.namespace, self.cfg.name, self.cfg.identity)
                    return
            except LeaseNamespaceMissing:
                raise
            except (KubeError, OSError) as exc:
                log.warning("lease: %s", exc)
            await asyncio.sleep(self.cfg.renew_seconds)

    async def keep(self) -> None:
        """Renew until the Lease is lost (another holder, or no renewal within the lease duration)."""
        while True:
            await asyncio.sleep(self.cfg.renew_seconds)
            try:
                if not await asyncio.to_thread(self.try_acquire_or_renew):
                    log.error("lease %s/%s lost to another holder", self.cfg.namespace, self.cfg.name)
                    return
            except (KubeError, OSError) as exc:
                log.warning("lease renewal failed: %s", exc)
                if time.monotonic() > self._last_renew + self.cfg.lease_seconds:
                    log.error("lease %s/%s expired without renewal", self.cfg.namespace, self.cfg.name)
                    return

    def release(self) -> None:
        """Give the Lease up at a clean exit so a standby takes over at once (blocking I/O)."""
        try:
            current = self.kube.get_or_none(self._path)
            if current is None or (current.get("spec") or {}).get("holderIdentity") != self.cfg.identity:
                return
            current["spec"]["holderIdentity"] = ""
            current["spec"]["leaseDurationSeconds"] = 1
            self.kube.request("PUT", self._path, current)
        except (KubeError, OSError) as exc:
            log.warning("lease release failed: %s", exc)
