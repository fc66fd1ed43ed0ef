"""The operator's ModelCatalog parts that need no cluster: when a catalog is listed again (from
its status alone, so a new leader agrees) and the credentials of its Secret."""

from __future__ import annotations

import base64
import json

import pytest

from wakegate.control.operator.catalogs import catalog_delay, secret_auths


def catalog(
    generation: int = 1, status: dict[str, object] | None = None, token: str | None = None, refresh: int = 60
) -> dict[str, object]:
    meta: dict[str, object] = {"name": "c", "namespace": "ns", "generation": generation}
    if token is not None:
        meta["annotations"] = {"wakegate.io/refresh": token}
    return {"metadata": meta, "spec": {"registry": "r.example", "refreshSeconds": refresh}, "status": status or {}}


NOW = 1767225600.0  # 2026-01-01T00:00:00Z


def test_a_catalog_is_listed_first_then_on_its_interval() -> None:
    assert catalog_delay(catalog(), NOW) == 0
    listed = {"lastRefreshTime": "2026-01-01T00:00:00Z", "observedGeneration": 1}
    assert catalog_delay(catalog(status=listed), NOW + 20) == 40
    assert catalog_delay(catalog(status=listed), NOW + 61) == 0
    assert catalog_delay(catalog(generation=2, status=listed), NOW + 20) == 0


def test_changing_the_refresh_annotation_lists_it_at_once() -> None:
    listed = {"lastRefreshTime": "2026-01-01T00:00:00Z", "observedGeneration": 1, "refreshToken": "a"}
    assert catalog_delay(catalog(status=listed, token="a"), NOW + 20) == 40
    assert catalog_delay(catalog(status=listed, token="b"), NOW + 20) == 0


def secret(config: object) -> dict[str, object]:
    return {"data": {".dockerconfigjson": base64.b64encode(json.dumps(config).encode()).decode()}}


def test_secret_credentials_are_read_and_never_named_in_errors() -> None:
    auth = base64.b64encode(b"robot:hunter2").decode()
    auths = secret_auths(secret({"auths": {"https://r.example": {"auth": auth}}}), "Secret ns/creds")
    found = auths.for_host("r.example")
    assert found is not None and found.username == "robot" and "hunter2" not in repr(found)
    with pytest.raises(ValueError, match=r"has no \.dockerconfigjson") as missing:
        secret_auths({"data": {"password": "aHVudGVyMg=="}}, "Secret ns/creds")
    assert "hunter2" not in str(missing.value)
    with pytest.raises(ValueError, match="not JSON"):
        secret_auths({"data": {".dockerconfigjson": base64.b64encode(b"hunter2").decode()}}, "Secret ns/creds")
