"""Known HTTP/2 floods against extproc's server inside a real gateway (`wakegate up`: Envoy,
extproc, a sim), while a prober sends requests through the gateway.

Each attack (tests/support/h2attack.py) goes straight to extproc's HTTP/2 port, as a local
process could. What must hold: the server ends the attacking connection with GOAWAY
ENHANCE_YOUR_CALM, for the limit the attack is about (its count in extproc's
wakegate_gateway_h2_refused_total goes up by one), long before the attack has sent everything,
and the prober's requests
keep being answered, none failed, none stalled. The bounds here are generous (this machine
is shared); the latencies themselves are measured by tests/bench/bench_h2_floods.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.support import h2attack
from tests.support.up import UpProcess, model_doc

MODEL = "flood-probe"
#: A prober request slower than this during an attack would mean the gateway stalled.
STALL_SECONDS = 5.0


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[UpProcess, int]]:
    tmp: Path = tmp_path_factory.mktemp("floods")
    limits = ["preface_timeout=1", "idle_timeout=1"]
    up = UpProcess(tmp, model_doc(MODEL, extra="  scaling: {min: 1, max: 1}\n"),
                   *(arg for limit in limits for arg in ("--extproc-h2-limit", limit)))  # fmt: skip
    try:
        up.wait_ready({MODEL: 1}, timeout=90)
        yield up, h2attack.extproc_port(up.state_dir)
    finally:
        assert up.stop() == 0, up.log()


@pytest.mark.parametrize("attack", h2attack.attacks(), ids=lambda a: a.name.replace(" ", "-"))
def test_flood_ends_the_connection_and_the_gateway_keeps_serving(gateway, attack: h2attack.Flood) -> None:
    up, port = gateway
    size = h2attack.SIZES[attack.name]
    with h2attack.Prober(up.port, MODEL) as prober:
        time.sleep(0.2)
        served_before = len(prober.latencies)
        admin = up.child_arg("extproc-0", "--admin-listen")  # the extproc attacked
        before = h2attack.refusals(admin)
        outcome = h2attack.flood("127.0.0.1", port, attack, size, seconds=60, reconnect=False)
        time.sleep(0.3)
        after = h2attack.refusals(admin)
    # The server ended the connection, for the limit this attack is about (the attacker may not
    # read the GOAWAY ENHANCE_YOUR_CALM: a close with unread input is a reset).
    assert outcome.cut == 1 and outcome.ended in ([h2attack.ENHANCE_YOUR_CALM], [None]), outcome
    assert after.get(attack.reason, 0) == before.get(attack.reason, 0) + 1, (before, after)
    assert outcome.frames < size, f"the server took the whole attack: {outcome}"
    assert not prober.failures, prober.failures
    assert len(prober.latencies) > served_before, "the prober was not served during the attack"
    assert max(prober.latencies) < STALL_SECONDS, sorted(prober.latencies)[-5:]


def test_silent_and_half_open_connections_are_closed(gateway) -> None:
    up, port = gateway
    with h2attack.Prober(up.port, MODEL) as prober:
        silent = h2attack.idle_connections("127.0.0.1", port, 50, preface=False)
        quiet = h2attack.idle_connections("127.0.0.1", port, 50, preface=True)
        try:
            # preface_timeout=1 closes the silent ones; idle_timeout=1 sends the quiet ones a
            # GOAWAY and a PING they never answer, and closes them a period later.
            assert all(h2attack.closed_by_server(s, 15) for s in silent)
            assert all(h2attack.closed_by_server(s, 15) for s in quiet)
        finally:
            for sock in silent + quiet:
                sock.close()
    assert not prober.failures, prober.failures
    assert prober.latencies and max(prober.latencies) < STALL_SECONDS


HELD = """  scaling: {min: 0, max: 1}
  endpoint: {maxQueue: 1000, coldMode: hold}
  args: [--startup-seconds, "2"]
"""


def test_held_requests_beyond_one_connections_stream_limit_are_all_answered(tmp_path: Path) -> None:
    """With 40 streams per extproc connection, 300 held cold requests need Envoy to open more
    connections (it learns the limit from its bootstrap, which `up` renders to match): every one
    is held, then answered once the model is up, none refused."""
    up = UpProcess(tmp_path, model_doc("held", extra=HELD),
                   "--extproc-h2-limit", "max_concurrent_streams=40")  # fmt: skip
    try:
        up.wait_ready({}, timeout=90)

        async def send_all() -> list[int]:
            body = {"model": "held", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector) as session:

                async def one() -> int:
                    async with session.post(f"{up.base_url}/chat/completions", json=body) as resp:
                        await resp.read()
                        return resp.status

                return await asyncio.gather(*(one() for _ in range(300)))

        statuses = asyncio.run(send_all())
        assert statuses == [200] * 300, sorted(set(statuses))
    finally:
        assert up.stop() == 0, up.log()
