"""What the node agent decides for ModelCaches: which nodes want them, its status entries, its labels."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from wakegate.control.agent.caching import Entry, EntryPhase, label_patch, model_may_run, status_body, wants
from wakegate.control.delivery_schema import ModelCache
from wakegate.control.k8s import names
from wakegate.control.k8s.objects import model_from_object, modelcache_from_object
from wakegate.control.schema import Model

DIGEST = "sha256:" + "ab" * 32
OTHER = "sha256:" + "cd" * 32
SOURCE = "oci://reg.example:5000/models/tiny:v1"


def cache(**spec: Any) -> ModelCache:
    return modelcache_from_object(
        {
            "apiVersion": names.API_VERSION,
            "kind": "ModelCache",
            "metadata": {"name": "warm", "namespace": "ns"},
            "spec": {"sources": [SOURCE], **spec},
        }
    )


def model(name: str = "m", **spec: Any) -> Model:
    return model_from_object(
        {
            "apiVersion": names.API_VERSION,
            "kind": "Model",
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"backend": "llamacpp", "source": SOURCE, **spec},
        }
    )


GPU_NODE = {names.NODE_GPU_VENDOR: "nvidia", names.NODE_GPU_ARCH: "sm90", "zone": "a"}
CPU_NODE = {"zone": "a"}


def test_a_node_selector_picks_the_nodes() -> None:
    warm = cache(nodeSelector={"zone": "a"})
    assert wants(warm, CPU_NODE, {})
    assert not wants(warm, {"zone": "b"}, {})
    assert wants(cache(), {}, {})  # no selector: every node with an agent cache


def test_model_ref_means_where_the_model_may_run() -> None:
    gpu = model(resources={"gpu": {"count": 1, "vendor": "nvidia", "arch": ["sm90"]}})
    by_ref = cache(modelRef={"name": "m"})
    assert wants(by_ref, GPU_NODE, {"m": gpu})
    assert not wants(by_ref, CPU_NODE, {"m": gpu})  # no GPU labels from the agent
    assert not wants(by_ref, {**GPU_NODE, names.NODE_GPU_ARCH: "sm80"}, {"m": gpu})
    assert not wants(by_ref, {**GPU_NODE, names.NODE_GPU_VENDOR: "amd"}, {"m": gpu})
    assert not wants(by_ref, GPU_NODE, {})  # the Model does not exist (yet)
    # the Model's own node selector, and the ModelCache's on top of it
    picky = model(nodeSelector={"zone": "b"})
    assert not model_may_run(picky, GPU_NODE) and model_may_run(picky, {"zone": "b"})
    assert not wants(cache(modelRef={"name": "m"}, nodeSelector={"zone": "c"}), {"zone": "b"}, {"m": picky})


@pytest.mark.parametrize(
    "sources, why",
    [
        (["file:///models/a.gguf"], "a node cache holds oci:// and hf://"),
        ([SOURCE, SOURCE], "twice"),
        ([], "at least 1"),
        (["oci://reg/repo"], "is not a registry host"),
    ],
)
def test_bad_sources_are_refused_with_the_reason(sources: list[str], why: str) -> None:
    with pytest.raises(ValidationError) as err:
        modelcache_from_object(
            {
                "apiVersion": names.API_VERSION,
                "kind": "ModelCache",
                "metadata": {"name": "x"},
                "spec": {"sources": sources},
            }
        )
    assert why in str(err.value)


def test_status_entries_carry_what_each_phase_knows() -> None:
    pulling = Entry(EntryPhase.PULLING, done=10, total=100).status("n1", SOURCE)
    assert pulling == {"node": "n1", "source": SOURCE, "phase": "Pulling", "bytesDone": 10, "bytesTotal": 100}
    ready = Entry(
        EntryPhase.READY, digest=DIGEST, size=100, file="tiny.gguf", ready_time="2026-12-01T20:00:00Z"
    ).status("n1", SOURCE)
    assert ready == {
        "node": "n1",
        "source": SOURCE,
        "phase": "Ready",
        "digest": DIGEST,
        "size": 100,
        "file": "tiny.gguf",
        "readyTime": "2026-12-01T20:00:00Z",
    }
    failed = Entry(EntryPhase.FAILED, reason="not_found", message="no tag v9").status("n1", SOURCE)
    assert failed == {"node": "n1", "source": SOURCE, "phase": "Failed", "reason": "not_found", "message": "no tag v9"}


def test_status_body_holds_only_this_nodes_entries() -> None:
    body = status_body("ns", "warm", "n1", {SOURCE: Entry(EntryPhase.PENDING)})
    assert body["metadata"] == {"name": "warm", "namespace": "ns"}
    assert body["status"] == {"nodes": [{"node": "n1", "source": SOURCE, "phase": "Pending"}]}
    # nothing wanted any more: an empty list gives this node's entries up
    assert status_body("ns", "warm", "n1", {})["status"] == {"nodes": []}


def test_labels_follow_what_the_cache_holds() -> None:
    label = names.cache_label(DIGEST)
    assert label == "cache.wakegate.io/sha256-" + "ab" * 28 and len(label.split("/")[1]) == 63
    assert label_patch([DIGEST], {"zone": "a"}) == {"metadata": {"labels": {label: "ready"}}}
    assert label_patch([DIGEST], {label: "ready"}) is None
    moved = label_patch([OTHER], {label: "ready", "zone": "a"})
    assert moved == {"metadata": {"labels": {names.cache_label(OTHER): "ready", label: None}}}


def test_prepare_cache_makes_the_directory_and_hands_it_over(tmp_path: Path) -> None:
    import os

    from wakegate.control.agent.main import prepare_cache

    target = tmp_path / "node" / "cache"
    assert prepare_cache(target, os.getuid()) == 0
    assert target.is_dir() and target.stat().st_uid == os.getuid() and target.stat().st_mode & 0o777 == 0o750
    (tmp_path / "file").write_text("x")
    assert prepare_cache(tmp_path / "file" / "below", os.getuid()) == 1  # one log line, status 1
