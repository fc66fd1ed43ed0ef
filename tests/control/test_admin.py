"""free_port: the ports `wakegate up` hands its children before they bind them."""

from __future__ import annotations

import itertools
import socket

import pytest

from wakegate.control import admin
from wakegate.control.admin import free_port


def test_one_process_never_hands_out_a_port_twice() -> None:
    # One `up` picks its extprocs' ports, then its replicas' ports, before the extprocs have bound
    # theirs: a port handed out twice is a child that can never bind (it happened: an extproc and
    # a sim replica were given the same port).
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)


def test_ports_lie_below_the_ephemeral_range_so_no_outgoing_connection_takes_them() -> None:
    low = admin._ephemeral_low()
    for _ in range(50):
        port = free_port()
        assert admin.PORT_FLOOR <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # and it is free


def test_a_port_something_listens_on_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        picks = itertools.chain([taken, taken], itertools.count(admin.PORT_FLOOR + 7))
        monkeypatch.setattr(admin.random, "randint", lambda _a, _b: next(picks))
        monkeypatch.setattr(admin, "_ephemeral_low", lambda: 65535)
        port = free_port()
        assert port != taken
        assert port >= admin.PORT_FLOOR + 7


def test_the_ports_a_child_binds_beside_its_own_are_free_and_never_handed_out_again() -> None:
    # An engine publishing KV events binds its HTTP port + 1 too: a replica given port P and
    # another given P + 1 crash-looped on "Address already in use" (it happened in the suite).
    kv_ports = [free_port(offsets=(1, 2)) for _ in range(100)]
    others = {free_port() for _ in range(2000)}
    taken = {p + o for p in kv_ports for o in (0, 1, 2)}
    assert len(taken) == 3 * len(kv_ports)  # no two children's ports overlap
    assert not taken & others
    for port in kv_ports[-10:]:
        for offset in (1, 2):
            with socket.socket() as sock:
                sock.bind(("", port + offset))  # free on every interface, as the engine binds it


def test_a_port_whose_neighbour_is_busy_is_skipped_for_a_child_that_binds_both(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        picks = itertools.chain([taken - 1], itertools.count(admin.PORT_FLOOR + 11, 7))
        monkeypatch.setattr(admin.random, "randint", lambda _a, _b: next(picks))
        monkeypatch.setattr(admin, "_ephemeral_low", lambda: 65535)
        port = free_port(offsets=(1,))
        assert port != taken - 1  # its + 1 is busy
        assert port >= admin.PORT_FLOOR + 11
