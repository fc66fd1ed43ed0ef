"""The pure half of the catalog: facts from manifests and configs, the table, Link headers,
the ModelCatalog status and when a catalog is listed again."""

from __future__ import annotations

import json

import pytest

from wakegate.control.delivery import catalog as cat
from wakegate.control.delivery import media
from wakegate.control.delivery.errors import ManifestError

DIGEST = "sha256:" + "ab" * 32


def manifest(*titles: str, size: int = 10) -> media.Manifest:
    layers = tuple(media.Descriptor(media.WEIGHT_RAW, DIGEST, size, {media.ANNOTATION_TITLE: t}) for t in titles)
    config = media.Descriptor(media.MODEL_CONFIG, DIGEST, 2)
    return media.Manifest(media.OCI_MANIFEST, media.MODEL_ARTIFACT, config, layers)


def config(**fields: object) -> bytes:
    return json.dumps({"descriptor": {"name": "x"}, "config": fields}).encode()


def test_the_config_wins_over_annotations_which_win_over_file_names() -> None:
    entry = cat.describe(
        "m/llama",
        "q4",
        DIGEST,
        media.OCI_MANIFEST,
        manifest("llama-7b-Q4_K_M.gguf", "tok.json"),
        config(architecture="llama", paramSize="7B"),
        {"org.cncf.model.quantization": "Q8_0", "org.cncf.model.architecture": "mistral"},
    )
    assert (entry.format, entry.architecture, entry.parameters, entry.quantization) == ("gguf", "llama", "7B", "Q8_0")
    assert entry.size == 20
    only_names = cat.describe("m/x", "v1", DIGEST, media.OCI_MANIFEST, manifest("x.F16.gguf"), None)
    assert (only_names.format, only_names.quantization, only_names.architecture) == ("gguf", "F16", None)
    precision = cat.describe(
        "m/x",
        "v1",
        DIGEST,
        media.OCI_MANIFEST,
        manifest("model.safetensors"),
        config(format="safetensors", precision="bf16"),
    )
    assert (precision.format, precision.quantization) == ("safetensors", "bf16")


def test_mixed_weights_and_a_broken_config_leave_facts_unknown() -> None:
    entry = cat.describe(
        "m/x", "v1", DIGEST, media.OCI_MANIFEST, manifest("a-Q4_0.gguf", "b-Q8_0.gguf", "c.bin"), b"not json"
    )
    assert (entry.format, entry.quantization) == (None, None)
    assert cat.table([entry])[1].split()[-4:] == ["-", "-", "-", "-"]


def test_prefixes_match_whole_path_segments() -> None:
    assert cat.matches("models/llama", ["models"]) and cat.matches("models", ["models/"])
    assert not cat.matches("models2/llama", ["models"])
    assert cat.matches("anything", [])


@pytest.mark.parametrize(
    ("header", "target"),
    [
        ('</v2/_catalog?last=b&n=2>; rel="next"', "/v2/_catalog?last=b&n=2"),
        ("<https://r.example/v2/x/tags/list?last=v9>; type=foo; rel=next", "https://r.example/v2/x/tags/list?last=v9"),
        ('</v2/_catalog?n=2>; rel="prev"', None),
        ("", None),
    ],
)
def test_the_next_page_comes_from_the_link_header(header: str, target: str | None) -> None:
    assert media.next_page(header) == target


def test_a_listing_page_is_a_list_of_names() -> None:
    assert media.listed_names(b'{"name": "x", "tags": null}', "tags", "x") == []
    assert media.listed_names(b'{"repositories": ["a", "b"]}', "repositories", "x") == ["a", "b"]
    with pytest.raises(ManifestError, match="not a list of names"):
        media.listed_names(b'{"repositories": [1]}', "repositories", "catalog")
    with pytest.raises(ManifestError, match="not JSON"):
        media.listed_names(b"<html>", "repositories", "catalog")


def test_the_deployed_model_and_adapter_documents() -> None:
    source = f"oci://r.example/m/tiny:v1@{DIGEST}"
    assert cat.model_document("tiny", source, min_replicas=1)["spec"] == {
        "backend": "llamacpp",
        "source": source,
        "scaling": {"min": 1},
    }
    adapter = cat.adapter_document("tiny-sql", source, "tiny")
    assert adapter["kind"] == "LoRAAdapter"
    assert adapter["spec"] == {"baseModel": "tiny", "source": source, "servedName": "tiny-sql"}


def entry(repo: str, tag: str = "v1", **notes: str) -> cat.Entry:
    return cat.Entry(repo, tag, DIGEST, 5, media.OCI_MANIFEST, format="gguf", annotations=notes)


def test_status_lists_entries_in_order_with_bounded_annotations() -> None:
    found = cat.Refreshed(
        (entry("b"), entry("a", **{"org.cncf.model.x": "y" * 1000, "com.vendor.secretish": "z"})),
        ("c: registry said no",),
    )
    status = cat.catalog_status(found, {}, "2026-01-01T00:00:00Z", 3, "1")
    assert [e["repository"] for e in status["entries"]] == ["a", "b"]
    assert status["entries"][0]["annotations"] == {"org.cncf.model.x": "y" * cat.MAX_ANNOTATION_VALUE}
    assert "mediaType" not in status["entries"][0]
    assert (status["entryCount"], status["observedGeneration"], status["refreshToken"]) == (2, 3, "1")
    (ready,) = status["conditions"]
    assert (ready["status"], ready["reason"]) == ("True", "Listed")
    assert "1 unreadable: c: registry said no" in ready["message"]


def test_a_failed_listing_keeps_what_was_seen_and_says_why() -> None:
    before = cat.catalog_status(cat.Refreshed((entry("a"),)), {}, "2026-01-01T00:00:00Z", 1, None)
    after = cat.catalog_status(
        cat.Refreshed((), (), ("unauthorized", "registry r asks for credentials")),
        before,
        "2026-01-01T00:05:00Z",
        1,
        None,
    )
    assert after["entries"] == before["entries"] and after["lastRefreshTime"] == "2026-01-01T00:05:00Z"
    (ready,) = after["conditions"]
    assert (ready["status"], ready["reason"], ready["lastTransitionTime"]) == (
        "False",
        "unauthorized",
        "2026-01-01T00:05:00Z",
    )
    again = cat.catalog_status(cat.Refreshed((), (), ("unauthorized", "still")), after, "2026-01-01T00:10:00Z", 1, None)
    assert again["conditions"][0]["lastTransitionTime"] == "2026-01-01T00:05:00Z"


def test_status_is_capped_at_the_entry_limit() -> None:
    many = tuple(entry(f"r{i:05}") for i in range(cat.MAX_STATUS_ENTRIES + 5))
    status = cat.catalog_status(cat.Refreshed(many), {}, "2026-01-01T00:00:00Z", 1, None)
    assert (len(status["entries"]), status["entryCount"], status["truncated"]) == (
        cat.MAX_STATUS_ENTRIES,
        cat.MAX_STATUS_ENTRIES + 5,
        5,
    )


def test_refresh_is_due_on_the_interval_a_new_generation_or_a_new_token() -> None:
    assert cat.refresh_delay(300, None, 1, None, None, None, 1000.0) == 0
    assert cat.refresh_delay(300, 1000.0, 1, 1, None, None, 1100.0) == 200
    assert cat.refresh_delay(300, 1000.0, 1, 1, None, None, 1400.0) == 0
    assert cat.refresh_delay(300, 1000.0, 2, 1, None, None, 1100.0) == 0  # the spec changed
    assert cat.refresh_delay(300, 1000.0, 1, 1, "2", "1", 1100.0) == 0  # the annotation changed
    assert cat.refresh_delay(300, 1000.0, 1, 1, "2", "2", 1100.0) == 200
    assert cat.parse_time("2026-01-01T00:00:00Z") == 1767225600.0
    assert cat.parse_time("yesterday") is None
