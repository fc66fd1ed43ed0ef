"""Tests for wakegate.extproc.picking: consistent-hash ring, session/prefix keys, least-loaded, Picker."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wakegate.extproc import picking
from wakegate.extproc.picking import REPORT_LAG, HashRing, InFlight, Picker, prefix_key, session_key

EPS4 = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"]
EP5 = "10.0.0.5:8000"
KEYS = [f"session-{i}" for i in range(10_000)]
NO_HEADERS: dict[str, str] = {}


def assign(ring: HashRing, keys: list[str]) -> dict[str, str | None]:
    return {k: ring.lookup(k) for k in keys}


# --- HashRing --------------------------------------------------------------------------------


def test_empty_ring() -> None:
    ring = HashRing([])
    assert ring.lookup("anything") is None
    assert len(ring) == 0


def test_single_endpoint_ring() -> None:
    ring = HashRing(["10.0.0.1:80"], vnodes=1)
    assert {ring.lookup(k) for k in KEYS[:100]} == {"10.0.0.1:80"}


def test_ring_is_deterministic_and_order_independent() -> None:
    a = assign(HashRing(EPS4), KEYS[:2000])
    b = assign(HashRing(list(reversed(EPS4)) + EPS4[:2]), KEYS[:2000])  # order and duplicates
    assert a == b


def test_ring_is_stable_across_processes() -> None:
    # Python's hash() is salted per process; the ring must not be.
    code = (
        "import json;from wakegate.extproc.picking import HashRing;"
        f"r=HashRing({EPS4!r});print(json.dumps([r.lookup(f'session-{{i}}') for i in range(200)]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345"},
    ).stdout
    assert json.loads(out) == [HashRing(EPS4).lookup(f"session-{i}") for i in range(200)]


def test_ring_spreads_keys() -> None:
    counts = Counter(assign(HashRing(EPS4), KEYS).values())
    assert set(counts) == set(EPS4)
    for ep in EPS4:
        assert counts[ep] >= 0.15 * len(KEYS), counts


def test_adding_fifth_endpoint_moves_about_a_fifth_onto_it() -> None:
    before = assign(HashRing(EPS4), KEYS)
    after = assign(HashRing([*EPS4, EP5]), KEYS)
    moved = [k for k in KEYS if before[k] != after[k]]
    assert 0.15 * len(KEYS) <= len(moved) <= 0.25 * len(KEYS)
    assert all(after[k] == EP5 for k in moved)


def test_removing_endpoint_moves_only_its_keys() -> None:
    before = assign(HashRing([*EPS4, EP5]), KEYS)
    gone = EPS4[1]
    after = assign(HashRing([ep for ep in [*EPS4, EP5] if ep != gone]), KEYS)
    for k in KEYS:
        if before[k] == gone:
            assert after[k] != gone
        else:
            assert after[k] == before[k]
    # Its keys spread over the survivors rather than all landing on one.
    assert len({after[k] for k in KEYS if before[k] == gone}) >= 3


def test_vnodes_must_be_positive() -> None:
    with pytest.raises(ValueError):
        HashRing(EPS4, vnodes=0)


def test_lookup_handles_odd_keys() -> None:
    ring = HashRing(EPS4)
    for key in ["", "\ud800lone-surrogate", "κλειδί", "x" * 100_000]:
        assert ring.lookup(key) in EPS4


_endpoint = st.builds(
    lambda a, b, port: f"10.{a}.{b}.1:{port}", st.integers(0, 255), st.integers(0, 255), st.integers(1, 65535)
)


@settings(max_examples=40, deadline=None)
@given(
    endpoints=st.lists(_endpoint, min_size=1, max_size=8, unique=True),
    extra=_endpoint,
    salt=st.text(max_size=8),
    vnodes=st.integers(min_value=1, max_value=40),
)
def test_ring_minimal_disruption(endpoints: list[str], extra: str, salt: str, vnodes: int) -> None:
    if extra in endpoints:
        return
    keys = [f"{salt}/{i}" for i in range(300)]
    base = HashRing(endpoints, vnodes)
    grown = HashRing([*endpoints, extra], vnodes)
    for k in keys:
        b, g = base.lookup(k), grown.lookup(k)
        assert b in endpoints
        assert g == b or g == extra  # adding moves keys only onto the new endpoint
    if len(endpoints) > 1:
        removed = endpoints[0]
        shrunk = HashRing(endpoints[1:], vnodes)
        for k in keys:
            b = base.lookup(k)
            s = shrunk.lookup(k)
            assert s != removed
            if b != removed:
                assert s == b  # removing moves only the removed endpoint's keys


# --- session_key -----------------------------------------------------------------------------


MESSAGES = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Tell me a joke"},
    {"role": "assistant", "content": "..."},
    {"role": "user", "content": "another"},
]


def test_session_key_priorities() -> None:
    body = {"session_id": "body-sid", "messages": MESSAGES}
    both = {"x-session-id": "hdr-sid", "x-conversation-id": "hdr-conv"}
    assert session_key(both, body) == "hdr-sid"
    assert session_key({"x-conversation-id": "hdr-conv"}, body) == "hdr-conv"
    assert session_key(NO_HEADERS, body) == "body-sid"
    expected = hashlib.sha256(
        json.dumps(MESSAGES[:5], sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    ).hexdigest()
    assert session_key(NO_HEADERS, {"messages": MESSAGES}) == expected


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        ({}, None),
        ({}, {}),
        ({}, {"messages": []}),
        ({}, {"messages": "not a list"}),
        ({}, {"session_id": 42}),
        ({}, {"session_id": ""}),
        ({"x-session-id": ""}, None),
        ({"x-session-id": "   "}, {}),
        ({"X-Session-Id": "upper-case names are not looked up"}, None),
        ({}, {"prompt": "completions have no session"}),
    ],
)
def test_session_key_none(headers: dict[str, str], body: dict[str, Any] | None) -> None:
    assert session_key(headers, body) is None


def test_session_key_empty_header_falls_through() -> None:
    assert session_key({"x-session-id": "", "x-conversation-id": "c"}, None) == "c"
    assert session_key({"x-session-id": " "}, {"session_id": "b"}) == "b"


def test_session_key_uses_first_five_messages_canonically() -> None:
    base = session_key(NO_HEADERS, {"messages": MESSAGES})
    # A later turn (6th+ message changes) keeps the key.
    assert session_key(NO_HEADERS, {"messages": [*MESSAGES[:5], {"role": "user", "content": "x"}]}) == base
    # Dict key order and JSON whitespace don't matter (canonical JSON).
    reordered = [{"content": m["content"], "role": m["role"]} for m in MESSAGES]
    assert session_key(NO_HEADERS, {"messages": reordered}) == base
    # A difference in the first five does.
    changed = [*MESSAGES[:3], {"role": "user", "content": "Tell me a poem"}, *MESSAGES[4:]]
    assert session_key(NO_HEADERS, {"messages": changed}) != base


def test_session_key_non_ascii_canonical() -> None:
    msgs = [{"role": "user", "content": "héllo ✓"}]
    expected = hashlib.sha256('[{"content":"héllo ✓","role":"user"}]'.encode()).hexdigest()
    assert session_key(NO_HEADERS, {"messages": msgs}) == expected


# --- prefix_key ------------------------------------------------------------------------------


SYSTEM = "You are a meticulous assistant. " * 50  # long shared system prompt (~1600 chars)


def chat(*msgs: tuple[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": r, "content": c} for r, c in msgs]}


def test_prefix_key_priorities() -> None:
    body = {"cache_key": "body-ck", **chat(("user", "hi"))}
    assert prefix_key({"x-cache-key": "hdr-ck"}, body) == "hdr-ck"
    assert prefix_key(NO_HEADERS, body) == "body-ck"
    assert prefix_key({"x-cache-key": ""}, body) == "body-ck"
    expected = hashlib.sha256(b"user\x1fhi").hexdigest()
    assert prefix_key(NO_HEADERS, chat(("user", "hi"))) == expected


def test_prefix_key_chat_format() -> None:
    body = chat(
        ("system", "S"),
        ("user", [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}]),
    )
    expected = hashlib.sha256(b"system\x1fS\x1euser\x1fab").hexdigest()
    assert prefix_key(NO_HEADERS, body) == expected
    # Truncation to prefix_chars.
    assert prefix_key(NO_HEADERS, body, prefix_chars=4) == hashlib.sha256(b"syst").hexdigest()


def test_prefix_key_shared_system_prompt_and_first_user_message() -> None:
    first = ("user", "Summarise the attached quarterly report in detail, please.")
    keys = {
        prefix_key(
            NO_HEADERS,
            chat(("system", SYSTEM), first, ("assistant", f"answer {i}"), ("user", f"follow-up {i}")),
        )
        for i in range(20)
    }
    assert len(keys) == 1 and None not in keys
    # With a short system prompt the first user message still decides, later turns don't.
    short = {
        prefix_key(NO_HEADERS, chat(("system", "S"), first, ("assistant", f"a{i}")), prefix_chars=70) for i in range(20)
    }
    assert len(short) == 1
    # A different system prompt gives a different key.
    other = prefix_key(NO_HEADERS, chat(("system", "Other. " * 300), first))
    assert other not in keys


def test_prefix_key_completions() -> None:
    long_prompt = "Once upon a time " * 100
    k1 = prefix_key(NO_HEADERS, {"prompt": long_prompt + "the end"})
    k2 = prefix_key(NO_HEADERS, {"prompt": [long_prompt + "a different end", "ignored"]})
    assert k1 == k2 == hashlib.sha256(long_prompt[:1024].encode()).hexdigest()
    assert prefix_key(NO_HEADERS, {"prompt": "short"}) == hashlib.sha256(b"short").hexdigest()


@pytest.mark.parametrize(
    "body",
    [
        None,
        {},
        {"messages": []},
        {"prompt": ""},
        {"prompt": []},
        {"prompt": [1, 2, 3]},
        {"prompt": 7},
        {"cache_key": 5},
    ],
)
def test_prefix_key_none(body: dict[str, Any] | None) -> None:
    assert prefix_key(NO_HEADERS, body) is None


def test_prefix_key_odd_messages() -> None:
    body = {
        "messages": [
            "junk",
            {"role": "user", "content": None},
            {"content": "x"},
            {"role": 3, "content": {"a": 1}},
        ]
    }
    assert prefix_key(NO_HEADERS, body) == hashlib.sha256(b"user\x1f\x1e\x1fx\x1e\x1f").hexdigest()


def test_prefix_key_reads_only_the_prefix() -> None:
    class Exploding(dict[str, Any]):
        def get(self, *_: Any, **__: Any) -> Any:
            raise AssertionError("message beyond the prefix was read")

    messages: list[Any] = [{"role": "system", "content": "x" * 2000}, Exploding()]
    assert prefix_key(NO_HEADERS, {"messages": messages}) is not None


def test_prefix_chars_must_be_positive() -> None:
    with pytest.raises(ValueError):
        prefix_key(NO_HEADERS, {"prompt": "p"}, prefix_chars=0)


# --- InFlight --------------------------------------------------------------------------------


def test_inflight_counts_and_floor() -> None:
    inflight = InFlight()
    inflight.acquire("a")
    inflight.acquire("a")
    assert inflight.count("a") == 2
    inflight.release("a")
    inflight.release("a")
    inflight.release("a")  # extra release: stays at 0
    inflight.release("never-seen")
    assert inflight.count("a") == 0
    assert inflight.count("never-seen") == 0
    assert inflight._counts == {}  # zero entries removed
    inflight.acquire("a")
    assert inflight.count("a") == 1
    assert inflight.total() == 1


def test_least_loaded_empty() -> None:
    assert InFlight().least_loaded([]) is None


def test_least_loaded_picks_least_busy() -> None:
    inflight = InFlight()
    for ep, n in zip(EPS4, [3, 1, 2, 5], strict=True):
        for _ in range(n):
            inflight.acquire(ep)
    assert inflight.least_loaded(EPS4) == EPS4[1]
    inflight.release(EPS4[2])
    inflight.release(EPS4[2])
    assert inflight.least_loaded(EPS4) == EPS4[2]
    # Endpoints not in the candidate list don't matter.
    assert inflight.least_loaded(EPS4[:1]) == EPS4[0]


def test_least_loaded_ties_rotate() -> None:
    inflight = InFlight()
    picks = Counter(inflight.least_loaded(EPS4) for _ in range(400))
    assert picks == Counter({ep: 100 for ep in EPS4})
    inflight.acquire(EPS4[0])
    picks = Counter(inflight.least_loaded(EPS4) for _ in range(300))
    assert picks == Counter({ep: 100 for ep in EPS4[1:]})


def test_tied_endpoints_split_the_picks_by_weight() -> None:
    """Weights (a federation's Cluster.spec.weight) divide the picks among endpoints tied on load."""
    inflight = InFlight()
    weights = {EPS4[0]: 300, EPS4[1]: 100, EPS4[2]: 50}  # EPS4[3] unnamed: weight 1
    picks = Counter(inflight.least_loaded(EPS4, weights=weights) for _ in range(4510))
    total = sum(weights.values()) + 1
    for ep in EPS4:
        share = weights.get(ep, 1) / total
        assert abs(picks[ep] / 4510 - share) < 0.01, (ep, picks[ep])
    # A heavy endpoint's picks are spread out, not taken in one run.
    run = [inflight.least_loaded(EPS4[:2], weights=weights) for _ in range(8)]
    assert run.count(EPS4[0]) == 6 and EPS4[1] in run[:4]


def test_weights_never_outrank_load() -> None:
    inflight = InFlight()
    inflight.acquire(EPS4[0])
    weights = {EPS4[0]: 1000, EPS4[1]: 1}
    assert {inflight.least_loaded(EPS4[:2], weights=weights) for _ in range(20)} == {EPS4[1]}
    # Engines' own reported loads count as well.
    inflight.release(EPS4[0])
    loads = {EPS4[0]: 4, EPS4[1]: 2}
    assert {inflight.least_loaded(EPS4[:2], loads, weights) for _ in range(20)} == {EPS4[1]}


def test_picker_passes_weights_to_least_loaded() -> None:
    picker = Picker()
    weights = {EPS4[0]: 3, EPS4[1]: 1}
    picks = Counter(picker.pick("m", "least-loaded", EPS4[:2], NO_HEADERS, None, shares=weights) for _ in range(400))
    assert picks == Counter({EPS4[0]: 300, EPS4[1]: 100})


def test_least_loaded_with_streaming_requests() -> None:
    """Short requests plus long-held streams: every pick is an endpoint with the fewest in flight."""
    inflight = InFlight()
    streams: list[str] = []
    short: list[str] = []
    for step in range(2000):
        ep = inflight.least_loaded(EPS4)
        assert ep is not None
        counts = [inflight.count(e) for e in EPS4]
        assert inflight.count(ep) == min(counts)
        inflight.acquire(ep)
        if step % 50 == 0 and len(streams) < 12:
            streams.append(ep)  # long-held: never released during the test
        else:
            short.append(ep)
        if len(short) > 3:  # short requests finish soon, in order
            inflight.release(short.pop(0))
    assert inflight.total() == len(streams) + len(short)
    # Busy endpoint: one with 10 streams gets nothing while others are idler.
    inflight = InFlight()
    for _ in range(10):
        inflight.acquire(EPS4[0])
    picks = []
    for _ in range(30):
        ep = inflight.least_loaded(EPS4)
        assert ep is not None
        picks.append(ep)
        inflight.acquire(ep)
    assert EPS4[0] not in picks
    assert Counter(picks) == Counter({ep: 10 for ep in EPS4[1:]})


# --- Picker ----------------------------------------------------------------------------------


def test_default_and_unknown_strategies() -> None:
    picker = Picker()
    for strategy in ("default", "round-robin", "", "PREFIX"):
        assert picker.pick("m", strategy, EPS4, {"x-session-id": "s"}, None) is None


@pytest.mark.parametrize("strategy", ["default", "session-affinity", "prefix", "least-loaded"])
def test_empty_endpoints(strategy: str) -> None:
    assert Picker().pick("m", strategy, [], {"x-session-id": "s"}, {"prompt": "p"}) is None


def test_session_affinity_same_session_same_endpoint() -> None:
    picker = Picker()
    first = {}
    for i in range(1000):
        first[i] = picker.pick("m", "session-affinity", EPS4, {"x-session-id": f"s{i}"}, None)
        picker.inflight.acquire(first[i] or "")  # load must not move sessions
    for i in range(1000):
        headers = {"x-session-id": f"s{i}"}
        assert picker.pick("m", "session-affinity", list(reversed(EPS4)), headers, None) == first[i]
    counts = Counter(first.values())
    assert set(counts) == set(EPS4)
    assert min(counts.values()) >= 150  # each of 4 gets >= 15%


def test_session_affinity_body_session_and_messages() -> None:
    picker = Picker()
    spread: Counter[str | None] = Counter()
    for i in range(200):
        five = [{"role": "user" if j % 2 == 0 else "assistant", "content": f"conv {i} turn {j}"} for j in range(5)]
        a = picker.pick("m", "session-affinity", EPS4, NO_HEADERS, {"messages": five})
        for later in range(3):  # the conversation grows: same first five, same endpoint
            extra = [{"role": "user", "content": f"later {later}"}] * (later + 1)
            assert picker.pick("m", "session-affinity", EPS4, NO_HEADERS, {"messages": five + extra}) == a
        spread[a] += 1
        c = picker.pick("m", "session-affinity", EPS4, NO_HEADERS, {"session_id": f"conversation {i}"})
        d = picker.pick("m", "session-affinity", EPS4, {"x-conversation-id": f"conversation {i}"}, None)
        assert c == d  # the same id through body or header: same endpoint
    assert set(spread) == set(EPS4)


def test_session_affinity_without_key_goes_least_loaded() -> None:
    picker = Picker()
    picker.inflight.acquire(EPS4[0])
    picker.inflight.acquire(EPS4[1])
    picker.inflight.acquire(EPS4[2])
    assert picker.pick("m", "session-affinity", EPS4, NO_HEADERS, {"prompt": "x"}) == EPS4[3]
    assert picker.pick("m", "prefix", EPS4, NO_HEADERS, None) == EPS4[3]


def test_prefix_strategy_routes_shared_prefixes_together() -> None:
    picker = Picker()
    chosen: dict[int, set[str | None]] = {}
    for doc in range(200):
        first = ("user", f"Document {doc}: please analyse it.")
        for tail in range(5):
            body = chat(("system", SYSTEM[:200]), first, ("assistant", f"reply {tail}"), ("user", f"more {tail}"))
            # prefix_chars=1024 covers the system prompt and first user message, plus tails: use a
            # Picker with a shorter prefix to prove the tails are ignored.
            picker.prefix_chars = len("system\x1f" + SYSTEM[:200] + "\x1euser\x1f" + first[1])
            chosen.setdefault(doc, set()).add(picker.pick("m", "prefix", EPS4, NO_HEADERS, body))
    assert all(len(s) == 1 for s in chosen.values())
    spread = Counter(next(iter(s)) for s in chosen.values())
    assert set(spread) == set(EPS4)


def test_prefix_strategy_long_system_prompt_default_prefix() -> None:
    picker = Picker()
    picks = {
        picker.pick("m", "prefix", EPS4, NO_HEADERS, chat(("system", SYSTEM), ("user", f"q{i}"))) for i in range(50)
    }
    assert len(picks) == 1  # the shared 1024-char prefix decides


def test_least_loaded_strategy() -> None:
    picker = Picker()
    picker.inflight.acquire(EPS4[0])
    picks = [picker.pick("m", "least-loaded", EPS4, {"x-session-id": "s"}, None) for _ in range(6)]
    assert EPS4[0] not in picks
    assert Counter(picks) == Counter({ep: 2 for ep in EPS4[1:]})


def test_picker_caches_ring_per_model(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[tuple[str, ...]] = []
    real = picking.HashRing

    class CountingRing(real):  # type: ignore[misc, valid-type]
        def __init__(self, endpoints: list[str], vnodes: int = 160) -> None:
            built.append(tuple(endpoints))
            super().__init__(endpoints, vnodes)

    monkeypatch.setattr(picking, "HashRing", CountingRing)
    picker = Picker()
    for i in range(100):
        picker.pick("m", "session-affinity", EPS4, {"x-session-id": f"s{i}"}, None)
        picker.pick("m", "session-affinity", list(reversed(EPS4)), {"x-session-id": f"s{i}"}, None)
    assert len(built) == 1
    picker.pick("other", "session-affinity", EPS4, {"x-session-id": "s"}, None)
    assert len(built) == 2
    before = {i: picker.pick("m", "session-affinity", EPS4, {"x-session-id": f"s{i}"}, None) for i in range(500)}
    after = {i: picker.pick("m", "session-affinity", [*EPS4, EP5], {"x-session-id": f"s{i}"}, None) for i in range(500)}
    assert len(built) == 3
    assert all(after[i] in (before[i], EP5) for i in range(500))
    picker.forget("m")
    picker.pick("m", "session-affinity", [*EPS4, EP5], {"x-session-id": "s"}, None)
    assert len(built) == 4


def test_least_loaded_counts_what_the_engine_reports_beyond_this_gateway() -> None:
    inflight = InFlight()
    picker = Picker()
    eps = ["10.0.0.1:80", "10.0.0.2:80"]
    # The gateway sent nothing, but the first engine reports 3 requests (other gateways, direct traffic).
    for _ in range(4):
        assert picker.pick("m", "least-loaded", eps, {}, None, {eps[0]: 3}) == eps[1]
    # The gateway's own count still wins when it is higher than a report.
    inflight.acquire(eps[1])
    inflight.acquire(eps[1])
    assert inflight.least_loaded(eps, {eps[0]: 1}) == eps[0]


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_stale_engine_report_fades_with_this_gateways_releases() -> None:
    clock = Clock()
    inflight = InFlight(clock)
    eps = ["10.0.0.1:80", "10.0.0.2:80"]
    inflight.acquire(eps[0])
    report = {eps[0]: 1}  # the engine's reading includes the request this gateway sent
    assert inflight.least_loaded(eps, report) == eps[1]
    inflight.release(eps[0])
    # The request ended after the reading: the same (now stale) report no longer counts it.
    assert inflight.engine_count(eps[0], 1) == 0
    assert {inflight.least_loaded(eps, report) for _ in range(4)} == set(eps)
    # A reading of more than this gateway ever had there counts the rest.
    assert inflight.engine_count(eps[0], 3) == 2
    assert inflight.engine_count(eps[0], 0) == 0
    # Once the gateway's request is older than REPORT_LAG, a reading is all others' traffic.
    clock.now += 2 * REPORT_LAG
    assert inflight.engine_count(eps[0], 1) == 1


def test_a_reading_that_arrives_after_the_request_ended_does_not_count_it() -> None:
    """A federation member probed during one of our requests reports it after it ended: the pick
    must not avoid that member for the probe interval (sequential traffic would all go one way)."""
    clock = Clock()
    inflight = InFlight(clock)
    eps = ["10.0.0.1:80", "10.0.0.2:80"]
    picks = []
    for _ in range(20):
        # The reading caught our last request if it went to the first member; it has ended by now.
        report = {eps[0]: 1} if picks and picks[-1] == eps[0] else {}
        ep = inflight.least_loaded(eps, report)
        assert ep is not None
        picks.append(ep)
        inflight.acquire(ep)
        clock.now += 0.05
        inflight.release(ep)
    assert Counter(picks) == {eps[0]: 10, eps[1]: 10}


def test_others_traffic_counts_beside_this_gateways_own() -> None:
    clock = Clock()
    inflight = InFlight(clock)
    eps = ["10.0.0.1:80", "10.0.0.2:80"]
    for _ in range(2):
        inflight.acquire(eps[0])
    # The engine holds our 2 plus 3 of others': 5 in all, more than the 4 we hold on the second.
    for _ in range(4):
        inflight.acquire(eps[1])
    assert inflight.engine_count(eps[0], 5) == 5
    assert inflight.least_loaded(eps, {eps[0]: 5, eps[1]: 4}) == eps[1]
    # Our requests end; the late reading still says 5: only others' 3 remain.
    for _ in range(2):
        inflight.release(eps[0])
    assert inflight.engine_count(eps[0], 5) == 3
    assert inflight.least_loaded(eps, {eps[0]: 5, eps[1]: 4}) == eps[0]


def test_the_peaks_carry_across_epochs() -> None:
    clock = Clock()
    clock.now = 10 * REPORT_LAG  # the start of an epoch
    inflight = InFlight(clock)
    ep = "10.0.0.1:80"
    for _ in range(3):
        inflight.acquire(ep)
    clock.now += REPORT_LAG * 0.9
    for _ in range(3):
        inflight.release(ep)
    assert inflight.recent_peak(ep) == 3
    clock.now += REPORT_LAG * 0.2  # the next epoch: the last one's peak is still recent
    assert inflight.recent_peak(ep) == 3
    inflight.acquire(ep)
    assert inflight.recent_peak(ep) == 3
    clock.now += REPORT_LAG  # two epochs on: only what was in flight since then
    assert inflight.recent_peak(ep) == 1
    clock.now += 2 * REPORT_LAG  # nothing moved for longer than REPORT_LAG: the count now
    assert inflight.recent_peak(ep) == 1
    inflight.release(ep)
    assert inflight.recent_peak(ep) == 1
    clock.now += 2 * REPORT_LAG
    assert inflight.recent_peak(ep) == 0
