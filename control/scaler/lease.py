"""The scaler's leader election: the shared Lease (control/k8s/lease.py) driven from a thread.

Only the Lease holder's builtin engine scales Deployments. The scaler's Kubernetes code is
blocking (the official client in threads), so this runs the shared acquire/renew/release
protocol in a loop of its own and reports changes through ``on_change(is_leader)``. A holder
that cannot renew steps down before its Lease could have been taken over.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from wakegate.control.k8s.client import Kube, KubeError
from wakegate.control.k8s.lease import LeaderLease, LeaseConfig

log = logging.getLogger("wakegate.scaler.lease")


class LeaseElector:
    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str,
        identity: str,
        on_change: Callable[[bool], None],
        *,
        lease_seconds: int = 15,
        renew_seconds: float = 5.0,
    ) -> None:
        self._lease = LeaderLease(kube, LeaseConfig(namespace, name, identity, lease_seconds, renew_seconds))
        self._on_change = on_change
        self.lease_seconds = lease_seconds
        self.renew_seconds = renew_seconds
        self.leader = False
        self._last_renew = 0.0

    def try_acquire(self) -> bool:
        """One attempt (blocking): True while this identity holds the Lease."""
        return self._lease.try_acquire_or_renew()

    def _set(self, leader: bool, change: str = "") -> None:
        if leader != self.leader:
            self.leader = leader
            cfg = self._lease.cfg
            log.info("lease %s/%s: %s", cfg.namespace, cfg.name, change or ("acquired" if leader else "lost"))
            self._on_change(leader)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                held = self.try_acquire()
            except (KubeError, OSError) as exc:
                log.warning("lease %s/%s: %s", self._lease.cfg.namespace, self._lease.cfg.name, exc)
                held = self.leader and time.monotonic() - self._last_renew < self.lease_seconds - self.renew_seconds
            if held:
                self._last_renew = time.monotonic()
            self._set(held)
            stop.wait(self.renew_seconds)
        if self.leader:
            self.release()
            self._set(False, "released")

    def release(self) -> None:
        """Give the Lease up on shutdown so a successor need not wait for it to expire."""
        self._lease.release()
