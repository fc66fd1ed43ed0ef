"""Leader election on a Lease: acquire, renew, take over only after the holder went quiet, release."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.fakekube import FakeApiServer
from wakegate.control.k8s import lease as lease_module
from wakegate.control.k8s.lease import LeaderLease, LeaseConfig

LEASE = "/apis/coordination.k8s.io/v1/namespaces/ns/leases/op"


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(lease_module.time, "monotonic", lambda: now[0])
    return now


def candidate(server: FakeApiServer, identity: str) -> LeaderLease:
    cfg = LeaseConfig(namespace="ns", name="op", identity=identity, lease_seconds=10, renew_seconds=2)
    return LeaderLease(server.kube(), cfg)


def holder(server: FakeApiServer) -> str:
    return str(server.objects[LEASE]["spec"]["holderIdentity"])


def test_first_candidate_acquires_second_waits_until_the_lease_expires(clock: list[float]) -> None:
    kube = FakeApiServer()
    a, b = candidate(kube, "a"), candidate(kube, "b")
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    clock[0] += 5
    assert a.try_acquire_or_renew()  # renewal changes renewTime: b restarts its wait
    clock[0] += 9
    assert not b.try_acquire_or_renew()
    clock[0] += 11  # a went quiet for longer than the lease
    assert b.try_acquire_or_renew()
    assert holder(kube) == "b"
    assert kube.objects[LEASE]["spec"]["leaseTransitions"] == 1
    assert not a.try_acquire_or_renew()


def test_release_lets_a_standby_take_over_at_once(clock: list[float]) -> None:
    kube = FakeApiServer()
    a, b = candidate(kube, "a"), candidate(kube, "b")
    assert a.try_acquire_or_renew()
    a.release()
    assert b.try_acquire_or_renew()


def test_racing_writers_cannot_both_win(clock: list[float], monkeypatch: pytest.MonkeyPatch) -> None:
    kube = FakeApiServer()
    a, b, c = candidate(kube, "a"), candidate(kube, "b"), candidate(kube, "c")
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew() and not c.try_acquire_or_renew()
    clock[0] += 11
    seen_by_c = c.kube.get_or_none(LEASE)
    assert b.try_acquire_or_renew()
    monkeypatch.setattr(c.kube, "get_or_none", lambda resource: seen_by_c)  # c read before b wrote
    assert not c.try_acquire_or_renew()
    assert holder(kube) == "b"


def test_a_missing_namespace_is_reported_not_retried(clock: list[float]) -> None:
    kube = FakeApiServer(missing_namespaces={"ns"})
    with pytest.raises(lease_module.LeaseNamespaceMissing) as info:
        candidate(kube, "a").try_acquire_or_renew()
    assert info.value.namespace == "ns" and info.value.status == 404


async def test_acquire_gives_up_at_once_when_the_namespace_is_missing(clock: list[float]) -> None:
    kube = FakeApiServer(missing_namespaces={"ns"})
    with pytest.raises(lease_module.LeaseNamespaceMissing):
        await asyncio.wait_for(candidate(kube, "a").acquire(), 30)  # retrying would sleep between tries
    assert len(kube.writes("POST")) == 1  # one attempt


async def test_acquire_still_retries_other_errors(clock: list[float], monkeypatch: pytest.MonkeyPatch) -> None:
    kube = FakeApiServer()
    kube.faults = [(500, "Internal Server Error", "etcd"), (403, "Forbidden", "rbac")]
    monkeypatch.setattr(lease_module.asyncio, "sleep", _no_sleep)
    lease = candidate(kube, "a")
    await asyncio.wait_for(lease.acquire(), 30)
    assert holder(kube) == "a"


async def _no_sleep(seconds: float) -> None:
    return None
