"""Manifests of model artifacts: layers become files as ORAS, KitOps and ModelPack mean them."""

from __future__ import annotations

import hashlib
import json
from pathlib import PurePosixPath
from typing import Any

import pytest

from wakegate.control.delivery import media
from wakegate.control.delivery.errors import ManifestError


def _digest(seed: str) -> str:
    return "sha256:" + hashlib.sha256(seed.encode()).hexdigest()


def _layer(media_type: str, seed: str, **annotations: str) -> dict[str, Any]:
    return {"mediaType": media_type, "digest": _digest(seed), "size": 10, "annotations": annotations}


def _manifest(*layers: dict[str, Any], artifact: str | None = media.MODEL_ARTIFACT) -> bytes:
    doc = {
        "schemaVersion": 2,
        "mediaType": media.OCI_MANIFEST,
        "config": _layer(media.OCI_EMPTY, "c"),
        "layers": list(layers),
    }
    if artifact:
        doc["artifactType"] = artifact
    return json.dumps(doc).encode()


def test_titled_layers_become_files_and_tar_layers_unpack() -> None:
    parsed = media.parse(
        _manifest(
            _layer(media.WEIGHT_RAW, "w", **{media.ANNOTATION_TITLE: "model.gguf"}),
            _layer("application/vnd.oci.image.layer.v1.tar+gzip", "d", **{media.ANNOTATION_TITLE: "tokenizer"}),
            _layer("application/vnd.kitops.modelkit.model.v1.tar", "k"),
            _layer(media.WEIGHT_CONFIG_RAW, "cfg", **{media.ANNOTATION_FILEPATH: "conf/config.json"}),
        )
    )
    assert isinstance(parsed, media.Manifest)
    files = media.files_of(parsed)
    assert [(f.unpack, str(f.path) if f.path else None) for f in files] == [
        (media.Unpack.FILE, "model.gguf"),
        (media.Unpack.TAR_GZIP, "tokenizer"),
        (media.Unpack.TAR, None),
        (media.Unpack.FILE, "conf/config.json"),
    ]


@pytest.mark.parametrize(
    ("layer", "says"),
    [
        (_layer("application/octet-stream", "x"), "has no file name"),
        (_layer(media.WEIGHT_RAW, "x", **{media.ANNOTATION_TITLE: "../../etc/cron.d/x"}), "leave the model"),
        (_layer("application/vnd.cncf.model.weight.v1.tar+zstd", "x"), "zstd"),
    ],
)
def test_layers_that_cannot_become_files_are_refused(layer: dict[str, Any], says: str) -> None:
    parsed = media.parse(_manifest(layer))
    assert isinstance(parsed, media.Manifest)
    with pytest.raises(ManifestError, match=says):
        media.files_of(parsed)


def test_two_layers_for_one_file_are_refused() -> None:
    title = {media.ANNOTATION_TITLE: "model.gguf"}
    parsed = media.parse(_manifest(_layer(media.WEIGHT_RAW, "a", **title), _layer(media.WEIGHT_RAW, "b", **title)))
    assert isinstance(parsed, media.Manifest)
    with pytest.raises(ManifestError, match="both named"):
        media.files_of(parsed)


def test_an_index_is_narrowed_to_the_model_or_this_platform() -> None:
    def entry(seed: str, **extra: Any) -> dict[str, Any]:
        return {"mediaType": media.OCI_MANIFEST, "digest": _digest(seed), "size": 100, **extra}

    def index(*entries: dict[str, Any]) -> media.Index:
        parsed = media.parse(
            json.dumps({"schemaVersion": 2, "mediaType": media.OCI_INDEX, "manifests": list(entries)}).encode()
        )
        assert isinstance(parsed, media.Index)
        return parsed

    arm = entry("arm", platform={"os": "linux", "architecture": "arm64"})
    amd = entry("amd", platform={"os": "linux", "architecture": "amd64"})
    assert media.choose(index(arm, amd)).digest == _digest("amd")
    assert media.choose(index(entry("only"))).digest == _digest("only")
    assert media.choose(index(arm, entry("model", artifactType=media.MODEL_ARTIFACT))).digest == _digest("model")
    with pytest.raises(ManifestError, match="no single model manifest"):
        media.choose(index(arm, entry("other", platform={"os": "windows", "architecture": "amd64"})))


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"not json", "not JSON"),
        (json.dumps({"schemaVersion": 1}).encode(), "schema 1"),
        (json.dumps({"schemaVersion": 2, "mediaType": "application/x-other"}).encode(), "unsupported"),
        (_manifest({"mediaType": media.WEIGHT_RAW, "digest": "md5:00", "size": 1}), "not a digest"),
    ],
)
def test_malformed_manifests_are_refused(body: bytes, says: str) -> None:
    with pytest.raises(ManifestError, match=says):
        media.parse(body)


def test_pushed_manifests_follow_modelpack_and_are_reproducible() -> None:
    layers = [
        media.layer_for(PurePosixPath("tiny.gguf"), _digest("w"), 10),
        media.layer_for(PurePosixPath("tokenizer.json"), _digest("t"), 5),
        media.layer_for(PurePosixPath("README.md"), _digest("r"), 3),
    ]
    assert [layer.media_type for layer in layers] == [media.WEIGHT_RAW, media.WEIGHT_CONFIG_RAW, media.DOC_RAW]
    config = media.model_config(layers, "tiny")
    assert json.loads(config) == {
        "descriptor": {"name": "tiny"},
        "config": {"format": "gguf"},
        "modelfs": {"type": "layers", "diff_ids": [layer.digest for layer in layers]},
    }
    desc = media.Descriptor(media.MODEL_CONFIG, _digest("c"), len(config))
    first, second = media.image_manifest(desc, layers), media.image_manifest(desc, layers)
    assert first == second
    doc = json.loads(first)
    assert doc["artifactType"] == media.MODEL_ARTIFACT and doc["mediaType"] == media.OCI_MANIFEST
    assert doc["layers"][0]["annotations"] == {
        media.ANNOTATION_TITLE: "tiny.gguf",
        media.ANNOTATION_FILEPATH: "tiny.gguf",
    }
