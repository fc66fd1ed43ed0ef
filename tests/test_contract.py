"""The contract across the control/extproc wall has one source, wakegate.contract, and cannot drift.

Three ways it could: a half keeps its own copy of a name (caught by scanning the sources), the
Model schema's words for strategies and cold modes leave routing.proto's enums behind, or the
proto gains a value the schema does not offer. Each check is also run on an edited copy of one
side, to show it fails when either side changes alone.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from tests.support import REPO_ROOT
from wakegate import contract
from wakegate.control.schema import ColdMode, Profile, Strategy, Weights
from wakegate.extproc.picking import STRATEGIES as PICKER_STRATEGIES
from wakegate.extproc.scorers import SCORERS
from wakegate.v1 import routing_pb2

#: Every string value the contract defines (the type URL included).
SHARED = {value for name, value in vars(contract).items() if name.isupper() and isinstance(value, str)}


def copies(sources: Mapping[str, str]) -> list[str]:
    """`path: literal` for every string literal in `sources` that is one of the contract's values."""
    found = []
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in SHARED:
                found.append(f"{path}: {node.value!r}")
    return found


def halves() -> dict[str, str]:
    files: Iterable[Path] = [*(REPO_ROOT / "control").rglob("*.py"), *(REPO_ROOT / "extproc").rglob("*.py")]
    return {str(f.relative_to(REPO_ROOT)): f.read_text() for f in files}


def mismatch(words: Iterable[str], wire: Mapping[str, int]) -> set[str]:
    """Words on one side only (schema enum vs the proto enum's derived words)."""
    return set(words) ^ set(wire)


def test_neither_half_keeps_its_own_copy_of_a_shared_name() -> None:
    assert {"x-wakegate-cluster", "x-gateway-destination-endpoint", "envoy.lb", "wakegate_extproc"} <= SHARED
    assert copies(halves()) == []


def test_a_copied_name_on_either_side_is_caught() -> None:
    edited_control = {"control/feeder/resources.py": 'CLUSTER_HEADER = "x-wakegate-cluster"\n'}
    edited_extproc = {"extproc/service.py": 'route = {"cluster": "wakegate_activator"}\n'}
    assert copies(edited_control) == ["control/feeder/resources.py: 'x-wakegate-cluster'"]
    assert copies(edited_extproc) == ["extproc/service.py: 'wakegate_activator'"]


def test_schema_words_are_the_proto_enums() -> None:
    assert mismatch((s.value for s in Strategy), contract.STRATEGIES) == set()
    assert mismatch((m.value for m in ColdMode), contract.COLD_MODES) == set()
    assert set(PICKER_STRATEGIES) == set(contract.STRATEGIES)
    assert contract.STRATEGIES["session-affinity"] == routing_pb2.STRATEGY_SESSION_AFFINITY
    assert contract.MODEL_ROUTE_TYPE == "type.googleapis.com/wakegate.v1.ModelRoute"


def test_schema_profiles_and_weights_are_the_scorers() -> None:
    names = [spec.name for spec in contract.SCORERS]
    assert {p.value for p in Profile} == set(contract.PROFILES)
    assert list(Weights.model_fields) == ["queue", "kvCache", "prefix", "precise", "session"]
    every = Weights(**{field: 1 for field in Weights.model_fields}).scorers()
    assert list(every) == names == list(SCORERS)
    assert all(set(weights) <= set(names) for weights in contract.PROFILES.values())


def test_a_scorer_spec_derives_its_field_and_module_from_its_name() -> None:
    spec = contract.ScorerSpec("kv-cache", "")
    assert (spec.field, spec.module) == ("kvCache", "wakegate.extproc.scorers.kv_cache")
    assert contract.ScorerSpec("x", "", module="my.scorer").module == "my.scorer"
    with pytest.raises(ValueError, match="lowercase words"):
        contract.ScorerSpec("kv_cache", "")


def test_an_enum_edited_on_either_side_is_caught() -> None:
    # The proto gains a strategy the schema does not offer.
    proto = descriptor_pb2.EnumDescriptorProto()
    routing_pb2.Strategy.DESCRIPTOR.CopyToProto(proto)
    proto.value.add(name="STRATEGY_RANDOM", number=9)
    words = contract.enum_names(((value.name, value.number) for value in proto.value), "STRATEGY_")
    assert mismatch((s.value for s in Strategy), words) == {"random"}
    # The schema renames a word the proto still spells the old way.
    renamed = [s.value for s in Strategy if s is not Strategy.LEAST_LOADED] + ["least-busy"]
    assert mismatch(renamed, contract.STRATEGIES) == {"least-busy", "least-loaded"}
