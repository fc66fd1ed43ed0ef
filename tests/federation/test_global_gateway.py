"""The global gateway over two real member gateways (each a whole `wakegate up`: Envoy, two
extprocs, feeder, sim backends), itself a real Envoy + extproc fed by its own xDS.

What a user of one endpoint over two clusters relies on: a model cold everywhere wakes in one
member only; requests spread over the members that have it warm; a member whose model scaled
to zero stops getting requests; a member gateway that dies mid-run fails no request that had
not reached it yet, and new requests go elsewhere within one health interval.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.federation import GlobalProcess, chat, federation_doc, member_port, refused_at_start
from tests.support.http import LoopbackServer, Reply, Response, request
from tests.support.up import UpProcess, model_doc, pids_alive
from wakegate import contract

INTERVAL = 0.5



def member_ready(member: UpProcess) -> int:
    return int(next(m["ready"] for m in member.status()["models"] if m["key"] == "chat"))


@dataclass
class Fleet:
    east: UpProcess
    west: UpProcess
    glob: GlobalProcess

    def member_of(self, response: Response) -> str:
        return {self.east.port: "east", self.west.port: "west"}[member_port(response)]


def _fleet(tmp_path: Path, east_scaling: str, west_scaling: str, placement: str) -> Iterator[Fleet]:
    started: list[UpProcess | GlobalProcess] = []
    try:
        for name, scaling in (("east", east_scaling), ("west", west_scaling)):
            folder = tmp_path / name
            folder.mkdir()
            extra = f"  servedName: org/chat\n  aliases: [small]\n  scaling: {scaling}\n"
            member = UpProcess(folder, model_doc("chat", extra=extra))
            started.append(member)
        east, west = started  # type: ignore[misc]
        for member in (east, west):
            member.wait_ready()
        glob = GlobalProcess(
            tmp_path,
            lambda port: federation_doc(
                {"east": east.port, "west": west.port}, port=port, placement=placement, interval=INTERVAL
            ),
        )
        started.append(glob)
        yield Fleet(east, west, glob)
    finally:
        for process in reversed(started):
            process.stop()


@pytest.fixture
def cold_fleet(tmp_path: Path) -> Iterator[Fleet]:
    """Both members serve `chat` from zero; east is woken first and idles out after 3 s."""
    yield from _fleet(
        tmp_path,
        "{min: 0, max: 1, idleTimeout: 3}",
        "{min: 0, max: 1, idleTimeout: 300}",
        "clusterSelector: {tier: gpu}, failover: [east, west]",
    )


def test_cold_everywhere_wakes_one_member_then_spreads_and_follows_scale_to_zero(cold_fleet: Fleet) -> None:
    fleet = cold_fleet
    glob = fleet.glob
    glob.wait_for(lambda s: all(m["reachable"] == "True" for m in s["members"].values()))
    # Cold in both: four requests at once are held at the global gateway, one member is woken.
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: chat(glob.url, "small"), range(4)))
    assert [a.status for a in answers] == [200] * 4, [a.text for a in answers]
    assert {fleet.member_of(a) for a in answers} == {"east"}  # first in failover order
    status = glob.status()
    assert status["counters"]["wakes"] == {"chat": 1}
    assert member_ready(fleet.west) == 0  # one activation, not one per member
    assert status["models"]["chat"]["summary"] == "east=Ready west=Idle"

    # West warms up (its own users woke it): the global gateway spreads over both.
    assert chat(fleet.west.url, "small").status == 200
    glob.wait_for(lambda s: s["routes"]["chat"] == ["east", "west"], timeout=10)
    with ThreadPoolExecutor(4) as pool:
        spread = Counter(fleet.member_of(a) for a in pool.map(lambda _: chat(glob.url, "small"), range(24)))
    assert spread["east"] >= 4 and spread["west"] >= 4, spread

    # East's Model scales to zero once idle: its route goes, requests go to west, nothing wakes east.
    deadline = time.monotonic() + 30
    while member_ready(fleet.east) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert member_ready(fleet.east) == 0
    glob.wait_for(lambda s: s["routes"]["chat"] == ["west"], timeout=5 * INTERVAL)
    later = [chat(glob.url, "small") for _ in range(8)]
    assert {(a.status, fleet.member_of(a)) for a in later} == {(200, "west")}
    assert glob.status()["counters"]["wakes"] == {"chat": 1} and member_ready(fleet.east) == 0


@pytest.fixture
def warm_fleet(tmp_path: Path) -> Iterator[Fleet]:
    yield from _fleet(tmp_path, "{min: 1, max: 1}", "{min: 1, max: 1}", "clusterSelector: {tier: gpu}")


@dataclass
class Sent:
    started: float
    status: int
    member: str | None
    text: str


def taken_by_east(sent: Sent) -> bool:
    """A failure of a request east's gateway had taken: its connection ended after the request
    went out. (East's Envoy answering for a request its dead extproc never decided, or one whose
    dead sim refused the connection, is no failure: that reply is marked unserved and the global
    gateway sends the request to west.)"""
    return "connection termination" in sent.text


def test_a_member_gateway_stopped_mid_run_fails_no_request_that_had_not_reached_it(warm_fleet: Fleet) -> None:
    fleet = warm_fleet
    glob = fleet.glob
    glob.wait_for(lambda s: s["routes"]["chat"] == ["east", "west"])
    # The global gateway's own extproc dies: it is restarted, and meanwhile a request gets 200
    # from the standby or the gateway's retriable 503 (never a 500), for a moment only.
    os.kill(glob.status()["components"]["extproc-0"]["pid"], signal.SIGKILL)
    during = [chat(glob.url, "small") for _ in range(10)]
    assert {a.status for a in during} <= {200, 503}
    assert all(a.json()["error"]["code"] == "gateway_unavailable" for a in during if a.status == 503)
    glob.wait_for(lambda s: s["components"]["extproc-0"]["restarts"] == 1 and s["components"]["extproc-0"]["running"])
    time.sleep(1.0)  # Envoy's health checks (every 250 ms) see it again
    assert {chat(glob.url, "small").status for _ in range(10)} == {200}
    print(f"\nglobal extproc killed: {sum(a.status == 503 for a in during)} of 10 requests right after got 503")
    sent: list[Sent] = []
    reroute: list[float] = []
    stop_at = time.monotonic() + 6.0
    killed_at: list[float] = []

    def worker() -> None:
        while time.monotonic() < stop_at:
            started = time.monotonic()
            answer = chat(glob.url, "small")
            member = fleet.member_of(answer) if "x-wakegate-upstream" in answer.headers else None
            sent.append(Sent(started, answer.status, member, answer.text[:200]))

    def watch_routes() -> None:
        while time.monotonic() < stop_at:
            if killed_at and glob.status()["routes"]["chat"] == ["west"]:
                reroute.append(time.monotonic() - killed_at[0])
                return
            time.sleep(0.02)

    # More clients than Envoy's default limit of concurrent retries (3): every request that meets
    # the dead member in the same moment is retried on the other, none refused for the limit.
    clients = 12
    threads = [threading.Thread(target=worker) for _ in range(clients)] + [threading.Thread(target=watch_routes)]
    for thread in threads:
        thread.start()
    time.sleep(2.0)
    envoy = fleet.east.status()["components"]["envoy"]["pid"]
    killed_at.append(time.monotonic())
    fleet.east.proc.send_signal(signal.SIGKILL)  # Envoy, extprocs, feeder and sims die with it
    while pids_alive([envoy]):
        time.sleep(0.001)
    gone_at = time.monotonic()  # from here no request can reach east's gateway
    for thread in threads:
        thread.join(60)
    fleet.east.stop()
    before = [s for s in sent if s.started < gone_at]
    after = [s for s in sent if s.started >= gone_at]
    failed_after = [s for s in after if s.status != 200]
    assert not failed_after, failed_after[:3]  # none of them had reached east: all answered by west
    assert {s.member for s in after} == {"west"}
    # Only requests east had already taken may fail (at most one per client thread), never replayed:
    # each says its connection to the member ended after the request went out. When the kill
    # reaches east's extproc a moment before its Envoy, that Envoy answers for requests it cannot
    # route any more, marked unserved, and the global gateway retries them on west.
    failed_before = [s for s in before if s.status != 200]
    assert len(failed_before) <= clients, failed_before
    assert all(s.member == "east" and taken_by_east(s) for s in failed_before), failed_before
    assert reroute and reroute[0] <= 2 * INTERVAL + 0.5, reroute
    status = glob.status()
    assert status["members"]["east"]["reachable"] == "False"
    assert status["counters"]["failovers"] >= 1
    retries = glob.envoy_stats(r"model_chat\.upstream_(rq_retry|rq_retry_success|cx_connect_fail)$")
    # What east could not take went to west: every retry the global Envoy made succeeded.
    assert retries["cluster.model_chat.upstream_rq_retry_success"] == retries["cluster.model_chat.upstream_rq_retry"]
    print(
        f"\nfederation failover: requests={len(sent)} before_gone={len(before)} after_gone={len(after)} "
        f"failed_in_flight_at_east={len(failed_before)} failed_after_kill={len(failed_after)} "
        f"reroute_s={reroute[0]:.3f} kill_to_gone_s={gone_at - killed_at[0]:.3f} health_interval_s={INTERVAL} "
        f"route_failovers={status['counters']['failovers']} envoy={retries}"
    )


class StandIn:
    """A member gateway that takes requests and cannot decide them: it reports what the member at
    `status_from` reports (so the global gateway routes to it) and answers every request itself
    with a 503, marked as having reached no model server (`unserved`) or not."""

    def __init__(self, status_from: str) -> None:
        self.unserved = True
        self.hits = 0
        self._lock = threading.Lock()
        self.status_from = status_from
        self.server = LoopbackServer(self.answer)
        self.port = self.server.port

    def answer(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Reply:
        if method == "GET":  # the global gateway's probe, with this member's token
            auth = {k: v for k, v in headers.items() if k.lower() == "authorization"}
            with urllib.request.urlopen(urllib.request.Request(self.status_from + path, headers=auth)) as got:
                return got.status, {"content-type": "application/json"}, got.read()
        with self._lock:
            self.hits += 1
        marker = {contract.UNSERVED_HEADER: "1"} if self.unserved else {}
        error = b'{"error": {"message": "down", "type": "service_unavailable", "code": "gateway_unavailable"}}'
        return 503, {"content-type": "application/json", "retry-after": "1", **marker}, error

    def close(self) -> None:
        self.server.close()


def test_a_members_reply_that_no_model_server_saw_is_retried_on_another_member_and_no_other_reply_is(
    tmp_path: Path,
) -> None:
    """A member whose gateway could not decide a request (its extproc gone: the reply marked
    unserved) costs the client nothing: the global gateway sends the request to another member.
    A member's 503 without the mark (a model server may have had the request) is never sent again."""
    started: list[UpProcess | GlobalProcess] = []
    stand_in: StandIn | None = None
    try:
        west = UpProcess(tmp_path, model_doc("chat", extra="  servedName: org/chat\n  aliases: [small]\n"))
        started.append(west)
        west.wait_ready()
        stand_in = StandIn(west.url)
        members = {"east": stand_in.port, "west": west.port}
        glob = GlobalProcess(tmp_path, lambda port: federation_doc(members, port=port, interval=INTERVAL))
        started.append(glob)
        glob.wait_for(lambda s: s["routes"]["chat"] == ["east", "west"])

        retried = r"model_chat\.upstream_rq_retry(_success)?$"

        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: chat(glob.url, "small"), range(24)))
        assert [a.status for a in answers] == [200] * 24, [a.text for a in answers if a.status != 200][:2]
        assert {member_port(a) for a in answers} == {west.port}
        assert stand_in.hits >= 1  # east was picked, and each time the request went on to west
        retries = glob.envoy_stats(retried)
        assert retries == {
            "cluster.model_chat.upstream_rq_retry": stand_in.hits,
            "cluster.model_chat.upstream_rq_retry_success": stand_in.hits,
        }

        stand_in.unserved, taken_before = False, stand_in.hits
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: chat(glob.url, "small"), range(24)))
        refused = [a for a in answers if a.status != 200]
        # Every request east took got east's reply and went nowhere else: no retry, no marker.
        assert len(refused) == stand_in.hits - taken_before >= 1
        assert all(a.status == 503 and contract.UNSERVED_HEADER not in a.headers for a in refused)
        assert all(member_port(a) == west.port for a in answers if a.status == 200)
        assert glob.envoy_stats(retried) == retries
    finally:
        for process in reversed(started):
            process.stop()
        if stand_in is not None:
            stand_in.close()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("127.0.0.1:1111", "gw.example:1111"), "Cluster 'east': gateway.url host 'gw.example' is not an IP address"),
        (("failover: [east]", "failover: [north]"), "FederatedModel 'chat': no Cluster 'north'"),
    ],
)
def test_a_bad_federation_file_is_one_line_and_status_2(tmp_path: Path, change: tuple[str, str], message: str) -> None:
    text = federation_doc({"east": 1111}, port=1112, placement="clusters: [east], failover: [east]")
    bad = tmp_path / "global.yaml"
    bad.write_text(text.replace(*change))
    done = refused_at_start(bad, tmp_path / "s")
    assert message in done.stderr, done.stderr


def test_members_get_their_own_token_and_clients_only_the_global_key(tmp_path: Path) -> None:
    """Each member gateway checks its own API key; the global gateway checks the clients' keys,
    drops them, and presents each member its token (from the Cluster's token file)."""
    started: list[UpProcess | GlobalProcess] = []
    try:
        for name in ("east", "west"):
            folder = tmp_path / name
            folder.mkdir()
            (folder / "keys").write_text(f"sk-member-{name}-0123456789\n")
            (tmp_path / f"{name}.token").write_text(f"sk-member-{name}-0123456789\n")
            extra = "  servedName: org/chat\n  aliases: [small]\n"
            started.append(UpProcess(folder, model_doc("chat", extra=extra), "--api-keys-file", str(folder / "keys")))
        east, west = started  # type: ignore[misc]
        for member in (east, west):
            member.wait_ready()
        (tmp_path / "clients").write_text("sk-client-0123456789\n")
        glob = GlobalProcess(
            tmp_path,
            lambda port: federation_doc(
                {"east": east.port, "west": west.port}, port=port, interval=INTERVAL, token_files=True,
                api_keys_file="clients",
            ),
        )  # fmt: skip
        started.append(glob)
        glob.wait_for(lambda s: s["routes"]["chat"] == ["east", "west"])
        fleet = Fleet(east, west, glob)
        client = {"authorization": "Bearer sk-client-0123456789"}
        body = {"model": "small", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        answers = [request("POST", f"{glob.url}/v1/chat/completions", headers=client, body=body) for _ in range(8)]
        assert [a.status for a in answers] == [200] * 8, answers[0].text
        assert {fleet.member_of(a) for a in answers} == {"east", "west"}  # each accepted its own token
        member_key = {"authorization": "Bearer sk-member-east-0123456789"}
        refused = request("POST", f"{glob.url}/v1/chat/completions", headers=member_key, body=body)
        assert refused.status == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        direct = request("POST", f"{east.url}/v1/chat/completions", headers=client, body=body)
        assert direct.status == 401  # the members do check: the client's key is not theirs
        assert "sk-member" not in json.dumps(glob.status()) and "sk-member" not in glob.log()
    finally:
        for process in reversed(started):
            process.stop()
