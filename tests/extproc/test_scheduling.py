"""Scored picking: each filter and scorer alone, the picker's ties, and the Picker end to end."""

from __future__ import annotations

import collections

import pytest

from wakegate.extproc.picking import Picker
from wakegate.extproc.prefix import BLOCK_CHARS, PrefixIndex, chain, prompt_text
from wakegate.extproc.scheduling import (
    QUEUE_LIMIT,
    EngineState,
    Request,
    Rotation,
    Signals,
    adapter_present,
    adapter_room,
    schedule,
    under_capacity,
    weights_for,
)
from wakegate.extproc.scorers import SCORERS
from wakegate.v1 import routing_pb2

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


def signals(inflight: dict[str, int] | None = None, engines: dict[str, EngineState] | None = None) -> Signals:
    counts = inflight or {}
    return Signals(lambda ep: counts.get(ep, 0), engines or {})


# ---- prefix chains and the index ------------------------------------------------------------


def test_chain_names_whole_prefixes() -> None:
    one = "a" * BLOCK_CHARS + "b" * BLOCK_CHARS + "tail"
    two = "a" * BLOCK_CHARS + "c" * BLOCK_CHARS
    h1, h2 = chain(one), chain(two)
    assert len(h1) == 2 and len(h2) == 2  # the partial tail is not a block
    assert h1[0] == h2[0] and h1[1] != h2[1]
    other_start = chain("x" * BLOCK_CHARS + "b" * BLOCK_CHARS)
    assert other_start[1] != h1[1]  # same second block, different parent
    assert chain("short") == []
    assert len(chain("z" * BLOCK_CHARS * 1000)) == 256  # bounded however long the prompt


def test_prompt_text_of_chat_and_completions() -> None:
    chat = {
        "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "U"}]}]
    }
    assert prompt_text(chat) == "system\x1fS\x1euser\x1fU"
    assert prompt_text({"prompt": ["P", "Q"]}) == "P"
    assert prompt_text({"prompt": 3}) == "" and prompt_text(None) == ""
    # a conversation's next turn starts with the previous turn's text
    turn2 = {"messages": [*chat["messages"], {"role": "assistant", "content": "A"}]}
    assert prompt_text(turn2).startswith(prompt_text(chat))


def test_prompt_text_stops_reading_a_long_history_once_the_hashed_part_is_covered() -> None:
    history = {"messages": [{"role": "user", "content": "x" * 1000} for _ in range(10_000)]}
    text = prompt_text(history, limit=5000)
    assert 5000 <= len(text) < 7000
    assert chain(prompt_text(history)) == chain(prompt_text(history, limit=10**9))  # same blocks hashed


def test_index_matches_longest_leading_run_per_endpoint() -> None:
    index = PrefixIndex()
    index.record(A, [1, 2, 3])
    index.record(B, [1, 2, 9])
    index.record(C, [7])
    assert index.matches([1, 2, 3, 4]) == {A: 3, B: 2}
    assert index.matches([5, 2, 3]) == {}  # a match must start at the first block
    assert index.matches([]) == {}


def test_index_is_a_bounded_lru_per_endpoint() -> None:
    index = PrefixIndex(capacity=4)
    index.record(A, [1, 2, 3])
    index.record(A, [1, 5])  # 1 refreshed, 5 added: 2 is now the oldest
    index.record(A, [6])
    assert index.blocks(A) == 4
    assert index.matches([1, 2]) == {A: 1}  # 2 was evicted
    index.record(B, [1, 2])
    assert index.matches([1, 2]) == {A: 1, B: 2}
    index.forget(B)
    assert index.matches([1, 2]) == {A: 1}
    index.retain([C])
    assert index.matches([1]) == {} and len(index) == 0


# ---- filters ---------------------------------------------------------------------------------


def test_adapter_filter_drops_only_endpoints_known_to_lack_it() -> None:
    engines = {A: EngineState(adapters=frozenset({"sql"})), B: EngineState(adapters=frozenset())}
    req = Request(adapter="sql")
    assert adapter_present([A, B, C], req, signals(engines=engines)) == [A, C]
    assert adapter_present([A, B, C], Request(), signals(engines=engines)) == [A, B, C]


def test_room_filter_sends_a_new_adapter_where_it_evicts_nothing() -> None:
    full = EngineState(adapters=frozenset({"a", "b"}), max_adapters=2)
    spare = EngineState(adapters=frozenset({"a"}), max_adapters=2)
    req = Request(adapter="sql")
    assert adapter_room([A, B, C], req, signals(engines={A: full, B: spare})) == [B, C]
    # Someone holds it: the room filter leaves the choice to adapter_present.
    holder = EngineState(adapters=frozenset({"sql", "x"}), max_adapters=2)
    assert adapter_room([A, B], req, signals(engines={A: full, B: holder})) == [A, B]
    assert adapter_room([A, B], Request(), signals(engines={A: full, B: full})) == [A, B]
    # Through the whole pick: the one with room wins over the full ones, the holder over all.
    picked = schedule([A, B, C], {"queue": 1}, req, signals(engines={A: full, B: spare, C: full}), Rotation())
    assert picked.endpoint == B
    picked = schedule([A, B, C], {"queue": 1}, req, signals(engines={A: full, B: spare, C: holder}), Rotation())
    assert picked.endpoint == C


def test_capacity_filter_uses_engine_queue_and_known_limits() -> None:
    engines = {
        A: EngineState(waiting=QUEUE_LIMIT),
        B: EngineState(max_running=4),
        C: EngineState(waiting=QUEUE_LIMIT - 1),
    }
    assert under_capacity([A, B, C], Request(), signals({B: 4}, engines)) == [C]
    assert under_capacity([A, B, C], Request(), signals({B: 3}, engines)) == [B, C]


def test_all_replicas_full_still_picks_the_least_loaded_of_them() -> None:
    engines = {A: EngineState(waiting=9), B: EngineState(waiting=5), C: EngineState(waiting=7)}
    decision = schedule([A, B, C], {"queue": 1.0}, Request(), signals(engines=engines), Rotation())
    assert decision.candidates == [A, B, C]  # the capacity filter would leave none: skipped
    assert decision.endpoint == B


# ---- scorers ---------------------------------------------------------------------------------


def test_queue_scorer_is_min_max_normalised() -> None:
    scores = SCORERS["queue"]([A, B, C], Request(), signals({A: 4, B: 0, C: 2}))
    assert scores == [0.0, 1.0, 0.5]
    assert SCORERS["queue"]([A, B], Request(), signals({A: 3, B: 3})) == [1.0, 1.0]


def test_queue_scorer_adds_other_gateways_requests_from_the_engine() -> None:
    # B: nothing from this gateway, but its engine holds 3 (other gateways' requests);
    # C: the engine's 2 were all this gateway's own when read, and 1 of them has ended since
    engines = {B: EngineState(waiting=3), C: EngineState(waiting=0, running=2, own=2)}
    scores = SCORERS["queue"]([A, B, C], Request(), signals({A: 2, B: 0, C: 1}, engines))
    assert scores == [0.5, 0.0, 1.0]  # depths 2, 3, 1


def test_kv_scorer_prefers_free_cache_and_is_neutral_when_unknown() -> None:
    engines = {A: EngineState(kv_usage=0.9), B: EngineState(kv_usage=0.1)}
    assert SCORERS["kv-cache"]([A, B, C], Request(), signals(engines=engines)) == pytest.approx([0.1, 0.9, 0.5])


def test_prefix_scorer_is_the_matched_share_of_the_chain() -> None:
    req = Request(chain=[1, 2, 3, 4], prefix_matches={A: 4, B: 1})
    assert SCORERS["prefix"]([A, B, C], req, signals()) == [1.0, 0.25, 0.0]
    assert SCORERS["prefix"]([A, B], Request(), signals()) == [0.0, 0.0]


def test_session_scorer_names_the_ring_owner() -> None:
    assert SCORERS["session"]([A, B], Request(session_owner=B), signals()) == [0.0, 1.0]


# ---- the picker ------------------------------------------------------------------------------


def test_ties_rotate_over_the_tied_endpoints_only() -> None:
    rotation = Rotation()
    load = signals({A: 0, B: 0, C: 5})
    picks = collections.Counter(
        schedule([A, B, C], {"queue": 1.0}, Request(), load, rotation).endpoint for _ in range(10)
    )
    assert picks == {A: 5, B: 5}


def test_weights_trade_prefix_against_load() -> None:
    req = Request(chain=[1, 2], prefix_matches={A: 2})
    busy_a = signals({A: 4, B: 0})
    # balanced (prefix 3, queue 1): A's full match beats B's idleness
    assert schedule([A, B], {"prefix": 3.0, "queue": 1.0}, req, busy_a, Rotation()).endpoint == A
    # load-heavy weights send it to the idle endpoint instead
    assert schedule([A, B], {"prefix": 1.0, "queue": 2.0}, req, busy_a, Rotation()).endpoint == B
    # a half match is worth less than a clearly idler endpoint under balanced weights
    half = Request(chain=[1, 2, 3, 4], prefix_matches={A: 1})
    assert schedule([A, B], {"prefix": 3.0, "queue": 1.0}, half, busy_a, Rotation()).endpoint == B


def test_an_empty_fleet_picks_nothing() -> None:
    assert schedule([], {"queue": 1.0}, Request(), signals(), Rotation()).endpoint is None


def test_weights_for_profiles_and_explicit_weights() -> None:
    assert weights_for("balanced", {}) == {"prefix": 3.0, "queue": 1.0}
    assert weights_for("balanced", {"queue": 1.0, "bogus": 5.0, "session": 0.0}) == {"queue": 1.0}
    assert weights_for("", {}) == {} and weights_for("no-such", {}) == {}


# ---- Picker: configuration, learning, endpoints going away ------------------------------------


def route(
    key: str, endpoints: list[str], profile: str = "", weights: dict[str, float] | None = None
) -> routing_pb2.ModelRoute:
    eps = [routing_pb2.Endpoint(address=e.split(":")[0], port=int(e.split(":")[1])) for e in endpoints]
    return routing_pb2.ModelRoute(key=key, endpoints=eps, profile=profile, weights=weights or {})


def chat(system: str, user: str) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def test_picker_learns_prefixes_from_its_own_picks() -> None:
    picker = Picker()
    picker.configure([route("m", [A, B, C], profile="balanced")])
    systems = [f"system prompt {n} " * 400 for n in range(3)]  # ~6 kB each: several blocks
    home = {}
    for n, system in enumerate(systems):
        home[n] = picker.pick("m", "default", [A, B, C], {}, chat(system, "first"))
    assert len(set(home.values())) == 3  # idle fleet, no history: spread by the tie rotation
    for n, system in enumerate(systems):
        for q in range(5):
            assert picker.pick("m", "default", [A, B, C], {}, chat(system, f"question {q}")) == home[n]


def test_picker_trades_affinity_for_load_when_the_home_is_busy() -> None:
    picker = Picker()
    picker.configure([route("m", [A, B], profile="balanced")])
    system = "shared " * 2000
    home = picker.pick("m", "default", [A, B], {}, chat(system, "q"))
    assert home is not None
    other = B if home == A else A
    for _ in range(3):
        picker.inflight.acquire(home)
    picker.engines[home] = EngineState(waiting=5)  # its engine is saturated: filtered out while B has room
    assert picker.pick("m", "default", [A, B], {}, chat(system, "q2")) == other


def test_a_replica_vanishing_mid_decision_is_survived() -> None:
    picker = Picker()
    picker.configure([route("m", [A, B, C], profile="balanced")])
    system = "vanishing " * 2000
    home = picker.pick("m", "default", [A, B, C], {}, chat(system, "q"))
    picker.inflight.acquire(home)
    # the route drops the home endpoint while its request is still in flight
    rest = [ep for ep in (A, B, C) if ep != home]
    picker.configure([route("m", rest, profile="balanced")])
    assert picker.index.blocks(home) == 0  # forgotten: a restarted engine's cache is empty
    assert picker.pick("m", "default", rest, {}, chat(system, "q2")) in rest
    picker.inflight.release(home)  # the old stream ends later: no error, no count left behind
    assert picker.inflight.count(home) == 0
    # an endpoint with engine state but no longer routed is dropped from the engine book
    picker.engines[home] = EngineState(waiting=1)
    picker.configure([route("m", rest, profile="balanced")])
    assert home not in picker.engines
    # endpoints passed to pick that the route table has not caught up with are scored too
    assert picker.pick("m", "default", [*rest, home], {}, chat("fresh " * 10, "q")) in [*rest, home]


def test_strategies_still_apply_without_a_profile() -> None:
    picker = Picker()
    picker.configure([route("m", [A, B]), route("p", [A, B], weights={"queue": 1.0})])
    assert picker.weights("m") is None and picker.weights("p") == {"queue": 1.0}
    assert picker.pick("m", "default", [A, B], {}, chat("s", "u")) is None  # Envoy's balancer
    picker.inflight.acquire(A)
    assert picker.pick("p", "default", [A, B], {}, chat("s", "u")) == B


def test_session_weights_keep_a_session_on_its_ring_owner() -> None:
    picker = Picker()
    picker.configure([route("m", [A, B, C], profile="sticky-sessions")])
    for s in range(10):
        owners = {
            picker.pick("m", "default", [A, B, C], {"x-session-id": f"s{s}"}, chat("x", str(i))) for i in range(4)
        }
        assert len(owners) == 1


def test_the_default_profile_sends_equal_prefix_matches_to_the_shorter_queue() -> None:
    picker = Picker()
    picker.configure([route("m", [A, B], profile="balanced")])
    body = chat("shared system prompt " * 300, "q")
    for endpoint in (A, B):  # both engines hold the whole prompt
        picker.index.record(endpoint, chain(prompt_text(body)))
    for _ in range(3):
        picker.inflight.acquire(A)
    assert [picker.pick("m", "default", [A, B], {}, body) for _ in range(4)] == [B] * 4
