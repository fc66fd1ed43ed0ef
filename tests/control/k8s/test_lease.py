"""Leader election on a Lease: acquire, renew, take over only after the holder went quiet, release."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from wakegate.control.k8s import lease as lease_module
from wakegate.control.k8s.client import KubeError
from wakegate.control.k8s.lease import LeaderLease, LeaseConfig


class FakeKube:
    """One Lease object with resourceVersion checks, like the API server."""

    def __init__(self) -> None:
        self.obj: dict[str, Any] | None = None
        self.version = 0

    def get_or_none(self, resource: str) -> Any:
        return None if self.obj is None else {**self.obj, "spec": dict(self.obj["spec"])}

    def request(self, method: str, resource: str, body: Any = None) -> Any:
        if method == "POST":
            if self.obj is not None:
                raise KubeError(409, "Conflict", "exists")
        elif body["metadata"].get("resourceVersion") != self.obj["metadata"]["resourceVersion"]:  # type: ignore[index]
            raise KubeError(409, "Conflict", "stale")
        self.version += 1
        self.obj = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.version)}}
        return self.obj


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(lease_module.time, "monotonic", lambda: now[0])
    return now


def candidate(kube: FakeKube, identity: str) -> LeaderLease:
    cfg = LeaseConfig(namespace="ns", name="op", identity=identity, lease_seconds=10, renew_seconds=2)
    return LeaderLease(kube, cfg)  # type: ignore[arg-type]


def test_first_candidate_acquires_second_waits_until_the_lease_expires(clock: list[float]) -> None:
    kube = FakeKube()
    a, b = candidate(kube, "a"), candidate(kube, "b")
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    clock[0] += 5
    assert a.try_acquire_or_renew()  # renewal changes renewTime: b restarts its wait
    clock[0] += 9
    assert not b.try_acquire_or_renew()
    clock[0] += 11  # a went quiet for longer than the lease
    assert b.try_acquire_or_renew()
    assert kube.obj is not None
    assert kube.obj["spec"]["holderIdentity"] == "b"
    assert kube.obj["spec"]["leaseTransitions"] == 1
    assert not a.try_acquire_or_renew()


def test_release_lets_a_standby_take_over_at_once(clock: list[float]) -> None:
    kube = FakeKube()
    a, b = candidate(kube, "a"), candidate(kube, "b")
    assert a.try_acquire_or_renew()
    a.release()
    assert b.try_acquire_or_renew()


def test_racing_writers_cannot_both_win(clock: list[float], monkeypatch: pytest.MonkeyPatch) -> None:
    kube = FakeKube()
    a, b, c = candidate(kube, "a"), candidate(kube, "b"), candidate(kube, "c")
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew() and not c.try_acquire_or_renew()
    clock[0] += 11
    seen_by_c = kube.get_or_none("")
    assert b.try_acquire_or_renew()
    monkeypatch.setattr(kube, "get_or_none", lambda resource: seen_by_c)  # c read before b wrote
    assert not c.try_acquire_or_renew()
    assert kube.obj is not None and kube.obj["spec"]["holderIdentity"] == "b"


class NoNamespaceKube(FakeKube):
    """The API server's answers when the Lease's namespace does not exist."""

    def get_or_none(self, resource: str) -> Any:
        return None  # GET of the Lease: 404

    def request(self, method: str, resource: str, body: Any = None) -> Any:
        self.version += 1
        raise KubeError(404, "Not Found", '{"message": "namespaces \\"ns\\" not found", "code": 404}')


def test_a_missing_namespace_is_reported_not_retried(clock: list[float]) -> None:
    kube = NoNamespaceKube()
    with pytest.raises(lease_module.LeaseNamespaceMissing) as info:
        candidate(kube, "a").try_acquire_or_renew()
    assert info.value.namespace == "ns" and info.value.status == 404


async def test_acquire_gives_up_at_once_when_the_namespace_is_missing(clock: list[float]) -> None:
    kube = NoNamespaceKube()
    with pytest.raises(lease_module.LeaseNamespaceMissing):
        await asyncio.wait_for(candidate(kube, "a").acquire(), 30)  # retrying would sleep between tries
    assert kube.version == 1  # one attempt


async def test_acquire_still_retries_other_errors(clock: list[float], monkeypatch: pytest.MonkeyPatch) -> None:
    kube = FakeKube()
    failures = [KubeError(500, "Internal Server Error", "etcd"), KubeError(403, "Forbidden", "rbac")]
    real = kube.request

    def flaky(method: str, resource: str, body: Any = None) -> Any:
        if failures:
            raise failures.pop(0)
        return real(method, resource, body)

    monkeypatch.setattr(kube, "request", flaky)
    monkeypatch.setattr(lease_module.asyncio, "sleep", _no_sleep)
    lease = candidate(kube, "a")
    await asyncio.wait_for(lease.acquire(), 30)
    assert kube.obj is not None and kube.obj["spec"]["holderIdentity"] == "a"


async def _no_sleep(seconds: float) -> None:
    return None
