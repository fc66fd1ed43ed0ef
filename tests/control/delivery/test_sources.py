"""Source strings: what each scheme accepts, and a clear refusal of everything else."""

from __future__ import annotations

import pytest

from wakegate.control.delivery.errors import SourceError
from wakegate.control.delivery.sources import (
    FileSource,
    HfSource,
    OciSource,
    PvcSource,
    parse_source,
    safe_relative,
)

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("oci://127.0.0.1:5000/models/tiny:v1", OciSource("127.0.0.1:5000", "models/tiny", "v1", None)),
        (f"oci://ghcr.io/org/llama@{DIGEST}", OciSource("ghcr.io", "org/llama", None, DIGEST)),
        (f"oci://localhost/a/b/c:q4_k_m@{DIGEST}", OciSource("localhost", "a/b/c", "q4_k_m", DIGEST)),
        ("oci://[::1]:5000/m:v1", OciSource("[::1]:5000", "m", "v1", None)),
        ("hf://TheOrg/Tiny-Model", HfSource("TheOrg/Tiny-Model", "main", None)),
        ("hf://org/repo@v1.0/weights/q4.gguf", HfSource("org/repo", "v1.0", "weights/q4.gguf")),
        ("hf://org/repo/*.gguf", HfSource("org/repo", "main", "*.gguf")),
        ("pvc://models-claim/llama/q4.gguf", PvcSource("models-claim", "llama/q4.gguf")),
        ("pvc://models", PvcSource("models", "")),
        ("file:///srv/models/tiny.gguf", FileSource("/srv/models/tiny.gguf")),
        ("file://models/tiny.gguf", FileSource("models/tiny.gguf")),
    ],
)
def test_each_scheme_parses_to_its_parts(text: str, expected: object) -> None:
    assert parse_source(text) == expected


def test_a_parsed_source_prints_back_to_a_source_that_parses_the_same() -> None:
    for text in ("oci://reg.io:443/a/b:v1", f"oci://reg.io/a@{DIGEST}", "hf://o/r@dev/x.gguf", "pvc://c/p"):
        parsed = parse_source(text)
        assert parse_source(str(parsed)) == parsed


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("", "non-empty"),
        ("s3://bucket/model", "must start with"),
        ("oci://", "names nothing"),
        ("oci://models/tiny:v1", "not a registry host"),
        ("oci://reg.io/Models/tiny:v1", "lower-case"),
        ("oci://reg.io/models/tiny", "name a tag"),
        ("oci://reg.io/models/tiny@sha256:abc", "not a digest"),
        ("oci://reg.io/models/tiny:" + "x" * 200, "not a tag"),
        ("hf://onlyrepo", "organisation and a repository"),
        ("hf://org/repo@", "not a revision"),
        ("hf://org/repo/../etc/passwd", "relative path"),
        ("hf://org/re po", "white space"),
        ("pvc://Bad_Claim/x", "claim name"),
        ("pvc://claim/../../etc", "relative path"),
    ],
)
def test_bad_sources_are_refused_naming_the_part(text: str, names: str) -> None:
    with pytest.raises(SourceError) as err:
        parse_source(text)
    assert names in str(err.value)
    assert err.value.reason == "bad_source"


@pytest.mark.parametrize("name", ["/etc/passwd", "../up", "a/../../b", "a//b", "", "a/\x00"])
def test_file_names_from_artifacts_cannot_leave_the_model_directory(name: str) -> None:
    with pytest.raises(SourceError):
        safe_relative(name)
    assert str(safe_relative("./sub/model.gguf")) == "sub/model.gguf"
