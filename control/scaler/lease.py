"""Leader election over a coordination.k8s.io/v1 Lease, so only one scaler scales Deployments.

The holder renews the Lease every ``renew_seconds``; another candidate takes it
over once ``renew_time + lease_duration_seconds`` has passed. Writes carry the
Lease's resourceVersion, so two candidates cannot both win a takeover (the
loser gets 409 Conflict). A holder that cannot renew within the lease duration
steps down before anyone else may take over. Runs in a thread (the Kubernetes
client is blocking) and reports changes through ``on_change(is_leader)``.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

log = logging.getLogger("wakegate.scaler.lease")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class LeaseElector:
    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        name: str,
        identity: str,
        on_change: Callable[[bool], None],
        *,
        lease_seconds: int = 15,
        renew_seconds: float = 5.0,
    ) -> None:
        self._api = client.CoordinationV1Api(api)
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self._on_change = on_change
        self.lease_seconds = lease_seconds
        self.renew_seconds = renew_seconds
        self.leader = False
        self._last_renew = 0.0

    def _spec(self, transitions: int, acquired: dt.datetime | None) -> dict[str, Any]:
        now = _now()
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.lease_seconds,
            "acquireTime": (acquired or now).isoformat(timespec="microseconds").replace("+00:00", "Z"),
            "renewTime": now.isoformat(timespec="microseconds").replace("+00:00", "Z"),
            "leaseTransitions": transitions,
        }

    def try_acquire(self) -> bool:
        """One election round: create, renew or take over the Lease; True while this candidate holds it."""
        try:
            lease = self._api.read_namespaced_lease(self.name, self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            body = {"metadata": {"name": self.name, "namespace": self.namespace}, "spec": self._spec(0, None)}
            try:
                self._api.create_namespaced_lease(self.namespace, body)
            except ApiException as create_exc:
                if create_exc.status == 409:
                    return False
                raise
            return True
        spec = lease.spec
        meta = {"name": self.name, "namespace": self.namespace, "resourceVersion": lease.metadata.resource_version}
        holder = spec.holder_identity
        transitions = spec.lease_transitions or 0
        if holder == self.identity:
            body = {"metadata": meta, "spec": self._spec(transitions, spec.acquire_time)}
        else:
            renewed = spec.renew_time or spec.acquire_time
            duration = spec.lease_duration_seconds or self.lease_seconds
            if holder and renewed is not None and _now() < renewed + dt.timedelta(seconds=duration):
                return False
            body = {"metadata": meta, "spec": self._spec(transitions + 1, None)}
        try:
            self._api.replace_namespaced_lease(self.name, self.namespace, body)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def _set(self, leader: bool) -> None:
        if leader != self.leader:
            self.leader = leader
            log.info("lease %s/%s: %s", self.namespace, self.name, "acquired" if leader else "lost")
            self._on_change(leader)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                held = self.try_acquire()
            except (ApiException, OSError) as exc:
                log.warning("lease %s/%s: %s", self.namespace, self.name, exc)
                held = self.leader and time.monotonic() - self._last_renew < self.lease_seconds - self.renew_seconds
            if held:
                self._last_renew = time.monotonic()
            self._set(held)
            stop.wait(self.renew_seconds)
        if self.leader:
            self.release()
            self._set(False)

    def release(self) -> None:
        """Give the Lease up on shutdown so a successor need not wait for it to expire."""
        try:
            lease = self._api.read_namespaced_lease(self.name, self.namespace)
            if lease.spec.holder_identity != self.identity:
                return
            body = {
                "metadata": {"resourceVersion": lease.metadata.resource_version},
                "spec": {"holderIdentity": None, "leaseTransitions": lease.spec.lease_transitions},
            }
            self._api.patch_namespaced_lease(self.name, self.namespace, body)
        except (ApiException, OSError) as exc:
            log.warning("lease %s/%s: release failed: %s", self.namespace, self.name, exc)
