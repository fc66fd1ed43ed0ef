"""Flow control through the real gateway (`wakegate up`: Envoy, two extprocs, sim backends).

One model, `fc`, runs on one sim replica that serves 2 requests at once (more wait in the sim);
flow control holds requests while the gateway has 2 in flight on it, up to 4 held. The key file
gives tenants and bands: a and b (standard), crit (critical), bulk (sheddable). Each test
saturates the model with slow requests and asserts who is served, who waits and who is refused.
A second model, `fcold`, starts from zero (3 s to load, one request at a time, up to 3 held): the
same rules hold while it wakes.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.http import Response, get_json, request
from tests.support.up import UpProcess, model_doc

KEYS = {"a": "sk-flow-a-0123456789", "b": "sk-flow-b-0123456789", "crit": "sk-flow-c-0123456789",
        "bulk": "sk-flow-d-0123456789", "open": "sk-flow-e-0123456789", "budget": "sk-flow-f-0123456789"}
#: Tenant t may use 60 tokens a minute: about five of these requests.
BUDGET = 60
KEYS_TEXT = (
    f"{KEYS['a']} fc tenant=a\n{KEYS['b']} fc tenant=b\n{KEYS['crit']} fc,fcold tenant=c band=critical\n"
    f"{KEYS['bulk']} fc,fcold tenant=d band=sheddable\n{KEYS['open']} fc\n"
    f"{KEYS['budget']} fc tenant=t tokens-per-minute={BUDGET}\n"
)
#: One request runs about 0.6 s on the sim (12 tokens at 20/s).
SLOW = {"model": "fc", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12}
FLEET = model_doc(
    "fc",
    extra="""  args: [--max-concurrency, "2", --tokens-per-second, "20"]
  scaling: {min: 1, max: 1}
  flowControl: {enabled: true, maxQueue: 4, queueTimeout: 8, saturation: {maxInFlight: 2, maxWaiting: 0}}
""",
) + model_doc(
    "fcold",
    extra="""  args: [--startup-seconds, "3", --tokens-per-second, "20"]
  scaling: {min: 0, max: 1, idleTimeout: 120}
  flowControl: {enabled: true, maxQueue: 3, queueTimeout: 8, saturation: {maxInFlight: 1, maxWaiting: 0}}
""",
)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    tmp = tmp_path_factory.mktemp("flow")
    keys = tmp / "keys.txt"
    keys.write_text(KEYS_TEXT)
    up = UpProcess(tmp, FLEET, "--api-keys-file", str(keys), "--fairness-header")
    try:
        up.wait_ready({"fc": 1})
        wait_active(up)
        yield up
    finally:
        up.stop()


class Sent:
    """A request sent from its own thread: its response and when it came back."""

    def __init__(self, gateway: UpProcess, who: str, headers: dict[str, str] | None = None, model: str = "fc") -> None:
        self.response: Response | None = None
        self.done_at = 0.0
        auth = {"authorization": f"Bearer {KEYS[who]}", **(headers or {})}
        body = {**SLOW, "model": model}

        def run() -> None:
            self.response = request("POST", f"{gateway.url}/v1/chat/completions", body=body, headers=auth, timeout=30)
            self.done_at = time.monotonic()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def result(self) -> Response:
        self._thread.join(30)
        assert self.response is not None
        return self.response


def send(
    gateway: UpProcess, who: str, n: int, headers: dict[str, str] | None = None, gap: float = 0.02, model: str = "fc"
) -> list[Sent]:
    sent = []
    for _ in range(n):
        sent.append(Sent(gateway, who, headers, model))
        time.sleep(gap)  # arrival order is the order sent
    return sent


def error(response: Response) -> dict[str, Any]:
    assert response.headers["content-type"].startswith("application/json"), response.text
    body: dict[str, Any] = response.json()["error"]
    return body


def statuses(sent: list[Sent]) -> list[int]:
    return [s.result().status for s in sent]


def test_a_tenant_over_its_share_gets_429_while_another_tenant_is_served(gateway: UpProcess) -> None:
    flood = send(gateway, "a", 8)  # 2 run, 4 held; then the queue is full and a alone waits: 503
    quiet = send(gateway, "b", 2)  # b takes the places of a's newest, which are over their share: 429
    # held requests are demand: the active extproc reports them queued (to the scaler, and here)
    admin = gateway.child_arg("extproc-0", "--admin-listen")
    deadline = time.monotonic() + 2
    while not any(m["model"] == "fc" and m["queued"] for m in get_json(f"http://{admin}/wakegate/queue")["models"]):
        assert time.monotonic() < deadline, "held requests not reported as queued"
        time.sleep(0.05)
    assert statuses(quiet) == [200, 200]
    codes = statuses(flood)
    refused = [s.result() for s in flood if s.result().status != 200]
    assert codes.count(200) >= 2 and codes.count(429) >= 1, codes
    for response in refused:
        expected = {429: ("over_share", "1"), 503: ("model_saturated", "5")}[response.status]
        assert (error(response)["code"], response.headers["retry-after"]) == expected


def test_critical_goes_first_and_sheddable_is_shed_first(gateway: UpProcess) -> None:
    bulk = send(gateway, "bulk", 6)  # 2 run, 4 held: the queue is full of sheddable requests
    crit = send(gateway, "crit", 3)  # each takes a sheddable request's place
    assert statuses(crit) == [200, 200, 200]
    shed = [s.result() for s in bulk if s.result().status == 503]
    assert len(shed) == 3 and all(error(r)["code"] == "shed" for r in shed), statuses(bulk)
    served_bulk_held = [s.done_at for s in bulk[2:] if s.result().status == 200]
    assert served_bulk_held and max(c.done_at for c in crit) <= min(served_bulk_held) + 0.3


def test_while_a_model_wakes_its_requests_wait_by_band_and_the_lowest_band_is_shed_first(gateway: UpProcess) -> None:
    bulk = send(gateway, "bulk", 3, model="fcold")  # it is cold: all three wait while it loads
    crit = send(gateway, "crit", 2, model="fcold")  # the queue is full: each takes a sheddable one's place
    deadline = time.monotonic() + 10
    while sum(s.response is not None for s in bulk) < 2:
        assert time.monotonic() < deadline, "no sheddable request was shed"
        time.sleep(0.05)
    # refused while the model still loads, not once it is ready
    assert [m["ready"] for m in gateway.status()["models"] if m["key"] == "fcold"] == [0]
    shed = [s.result() for s in bulk if s.response is not None]
    assert all(r.status == 503 and error(r)["code"] == "shed" for r in shed), [r.text for r in shed]
    # ready: one at a time, critical first
    assert statuses(crit) == [200, 200]
    kept = [s for s in bulk if s.result().status == 200]
    assert len(kept) == 1 and max(c.done_at for c in crit) < kept[0].done_at


def test_a_request_can_lower_its_band_not_raise_it(gateway: UpProcess) -> None:
    lowered = request(
        "POST",
        f"{gateway.url}/v1/chat/completions",
        body=SLOW,
        headers={"authorization": f"Bearer {KEYS['a']}", "x-wakegate-priority": "bogus"},
    )
    assert lowered.status == 400 and error(lowered)["code"] == "invalid_priority"
    held = send(gateway, "a", 6)  # 2 run, 4 standard requests held: the queue is full
    # a critical key asking for sheddable is below everything held: the model cannot take it
    lowered_crit = send(gateway, "crit", 1, {"x-wakegate-priority": "sheddable"})
    assert statuses(lowered_crit) == [503] and error(lowered_crit[0].result())["code"] == "model_saturated"
    # a sheddable key asking for critical stays sheddable
    raised = send(gateway, "bulk", 1, {"x-wakegate-priority": "critical"})
    assert statuses(raised) == [503]
    assert statuses(held) == [200] * 6


def test_the_fairness_header_names_the_tenant_of_keys_without_one(gateway: UpProcess) -> None:
    # Two clients with one key: told apart by the header, each gets its share.
    flood = send(gateway, "open", 8, {"x-gateway-inference-fairness-id": "noisy"})
    quiet = send(gateway, "open", 2, {"x-gateway-inference-fairness-id": "quiet"})
    assert statuses(quiet) == [200, 200]
    assert 429 in statuses(flood)


def wait_active(gateway: UpProcess, timeout: float = 30) -> None:
    """Until the active extproc decides every request: right after a start (or a restart) Envoy
    may still send some streams to the standby, whose queues and in-flight counts are its own."""
    probe = {"authorization": f"Bearer {KEYS['a']}"}
    deadline = time.monotonic() + timeout
    while True:
        before = [extproc_metric(gateway, i, "wakegate_gateway_requests_total") for i in (0, 1)]
        for _ in range(3):
            request("GET", f"{gateway.url}/v1/models", headers=probe)
        after = [extproc_metric(gateway, i, "wakegate_gateway_requests_total") for i in (0, 1)]
        if after[0] - before[0] == 3 and after[1] == before[1]:
            return
        assert time.monotonic() < deadline, "the active extproc does not take every request"
        time.sleep(0.5)


def extproc_metric(gateway: UpProcess, index: int, name: str) -> float:
    admin = gateway.child_arg(f"extproc-{index}", "--admin-listen")
    text = request("GET", f"http://{admin}/metrics").text
    prefix = name if "{" in name else name + "{"
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def test_the_standby_extproc_takes_over_flow_control_when_the_active_one_dies(gateway: UpProcess) -> None:
    before = extproc_metric(gateway, 1, "wakegate_gateway_flow_dispatched_total")
    pid = gateway.status()["components"]["extproc-0"]["pid"]
    os.kill(pid, signal.SIGKILL)
    # While extproc-0 is down (up restarts it), the standby decides: it holds and dispatches too.
    flood = send(gateway, "a", 5)
    quiet = send(gateway, "b", 1)
    assert statuses(quiet) == [200]
    assert statuses(flood).count(200) >= 4
    assert extproc_metric(gateway, 1, "wakegate_gateway_flow_dispatched_total") > before
    deadline = time.monotonic() + 30
    while gateway.status()["components"]["extproc-0"]["pid"] == pid or not _serving(gateway, 0):
        assert time.monotonic() < deadline, "extproc-0 was not restarted"
        time.sleep(0.2)
    wait_active(gateway)
    # back: the restarted active extproc admits again
    assert statuses(send(gateway, "b", 3)) == [200, 200, 200]


def _serving(gateway: UpProcess, index: int) -> bool:
    try:
        admin = gateway.child_arg(f"extproc-{index}", "--admin-listen")
        return bool(get_json(f"http://{admin}/healthz"))
    except (OSError, ValueError, KeyError):
        return False


def test_flow_control_keeps_the_model_decided(gateway: UpProcess, tmp_path: Path) -> None:
    model = next(m for m in gateway.status()["models"] if m["key"] == "fc")
    assert model.get("routingPath", "decided") == "decided"


def test_a_tenant_over_its_token_budget_gets_429_while_another_is_served(gateway: UpProcess) -> None:
    auth = {"authorization": f"Bearer {KEYS['budget']}"}
    url = f"{gateway.url}/v1/chat/completions"
    streamed = {**SLOW, "stream": True, "stream_options": {"include_usage": True}}
    answers = [request("POST", url, body=SLOW, headers=auth)]  # one plain JSON response
    while answers[-1].status == 200 and len(answers) < 12:
        answers.append(request("POST", url, body=streamed, headers=auth))
        time.sleep(0.1)  # the access log's entry reaches the extprocs
    refused = answers[-1]
    assert refused.status == 429, [a.status for a in answers]
    assert error(refused)["code"] == "token_budget" and int(refused.headers["retry-after"]) >= 1
    served = len(answers) - 1
    # each request used at least its 12 completion tokens: refused once 60 were used, not before
    assert 2 <= served <= BUDGET // 12 + 2, served
    assert statuses(send(gateway, "b", 1)) == [200]  # another tenant is served meanwhile
    # both extprocs counted the same tokens (from the access log), streamed usage included
    counted = [extproc_metric(gateway, i, 'wakegate_gateway_tenant_tokens_total{tenant="t"') for i in (0, 1)]
    assert counted[0] == counted[1] >= BUDGET, counted
