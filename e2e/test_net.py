"""The pod network's life cycle without a cluster: create, stale reaping, collisions (needs root)."""

from __future__ import annotations

import subprocess

import pytest

from e2e import net

pytestmark = pytest.mark.e2e


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_two_networks_get_disjoint_ranges_and_destroy_leaves_nothing() -> None:
    a = net.create(2)
    try:
        b = net.create(1)
        try:
            assert a.cidr != b.cidr
            with pytest.raises(net.NetError, match="overlaps"):
                net.create(1, cidr=a.cidr)
            assert set(net.netns_names()) >= {n.netns for n in a.nodes + b.nodes}
        finally:
            net.destroy(b)
        assert net.leftovers(b) == []
        assert net.leftovers(a) != []  # the other one is untouched
    finally:
        net.destroy(a)
    assert net.leftovers(a) == []


def test_a_dead_clusters_network_is_reaped_at_the_next_create() -> None:
    stale = net.create(2, owner=dead_pid())
    assert net.leftovers(stale) != []
    fresh = net.create(1)
    try:
        assert net.leftovers(stale) == []
        assert not stale.registry.exists()
        assert net.leftovers(fresh) != []
    finally:
        net.destroy(fresh)


def test_unclaimed_namespace_with_our_name_pattern_is_reaped() -> None:
    # What a crash between `ip netns add` and the record's removal could leave.
    net.ip("netns", "add", "wgdead00-0")
    try:
        net.reap_stale()
        assert "wgdead00-0" not in net.netns_names()
    finally:
        net.ip("netns", "del", "wgdead00-0", check=False)
