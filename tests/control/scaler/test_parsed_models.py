"""The scaler's Model watch parses a Model again only when what it is made of changed."""

from __future__ import annotations

from typing import Any

import pytest

from wakegate.control.k8s.watch import ListWatch
from wakegate.control.scaler import kube as scaler_kube
from wakegate.control.scaler.kube import ParsedModels


class Watch:
    """A watch that has just listed (`changed` None): every call looks at every object."""

    changed = None

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}

    def items(self) -> list[dict[str, Any]]:
        return list(self.objects.values())


class Listing:
    """The API server as a ListWatch's list sees it."""

    def __init__(self, objects: list[dict[str, Any]]) -> None:
        self.objects = objects

    def request(self, method: str, resource: str, **_: Any) -> dict[str, Any]:
        return {"items": self.objects, "metadata": {"resourceVersion": "1"}}


def model(name: str, generation: int = 1, status: str = "Idle", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "wakegate.io/v1alpha1",
        "kind": "Model",
        "metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}", "generation": generation},
        "spec": {"backend": "sim", **spec},
        "status": {"phase": status},
    }


def test_status_writes_cost_no_parse_and_hand_over_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[str] = []
    real = scaler_kube.model_from_object

    def counting(body: Any) -> Any:
        parsed.append(body["metadata"]["name"])
        return real(body)

    monkeypatch.setattr(scaler_kube, "model_from_object", counting)
    watch, models = Watch(), ParsedModels()
    assert models(watch) == []  # the first call hands over even an empty set
    for i in range(300):
        watch.objects[f"m{i}"] = model(f"m{i}")
    first = models(watch)
    assert first is not None and len(first) == 300 and len(parsed) == 300

    # The operator writes status on every Model: nothing to parse, nothing to hand over.
    parsed.clear()
    for i in range(300):
        watch.objects[f"m{i}"] = model(f"m{i}", status="Ready")
    assert models(watch) is None and parsed == []

    # One spec change (the API server moves the generation): that Model alone is parsed again.
    watch.objects["m7"] = model("m7", generation=2, scaling={"min": 1})
    again = models(watch)
    assert again is not None and parsed == ["m7"]
    by_key = {m.key: m for m in again}
    assert by_key["ns/m7"].spec.scaling.min == 1
    assert all(by_key[m.key] is m for m in first if m.key != "ns/m7")

    # A deleted Model leaves the set.
    del watch.objects["m8"]
    again = models(watch)
    assert again is not None and "ns/m8" not in {m.key for m in again} and parsed == ["m7"]


def test_an_invalid_model_is_left_out_with_one_warning_until_it_changes(caplog: pytest.LogCaptureFixture) -> None:
    watch, models = Watch(), ParsedModels()
    watch.objects["good"] = model("good")
    watch.objects["bad"] = model("bad", scaling={"min": -1})
    assert [m.name for m in models(watch) or []] == ["good"]
    assert caplog.text.count("ignoring Model ns/bad") == 1
    watch.objects["bad"] = model("bad", status="Failed")  # a status write: no new warning
    assert models(watch) is None and caplog.text.count("ignoring Model ns/bad") == 1
    watch.objects["bad"] = model("bad", generation=2, scaling={"min": 0})
    assert sorted(m.name for m in models(watch) or []) == ["bad", "good"]


def test_after_a_list_each_event_looks_at_its_own_model_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """1,000 Models: a watch event (a status write, a new Model, a deletion) never walks the set."""
    handed: list[list[Any] | None] = []
    models = ParsedModels()
    watch = ListWatch(Listing([model(f"m{i}") for i in range(1000)]), "models", "/models",  # type: ignore[arg-type]
                      on_change=lambda w: handed.append(models(w)))
    watch._list()
    assert len(handed[-1] or []) == 1000
    walks: list[int] = []
    real_items = watch.items
    monkeypatch.setattr(watch, "items", lambda: walks.append(1) or real_items())
    for i in range(1000):
        watch._apply({"type": "MODIFIED", "object": model(f"m{i}", status="Ready")})
    assert handed[1:] == [None] * 1000  # status writes: nothing handed over
    watch._apply({"type": "ADDED", "object": model("new")})
    assert {m.name for m in handed[-1] or []} == {f"m{i}" for i in range(1000)} | {"new"}
    watch._apply({"type": "DELETED", "object": model("m5")})
    assert "m5" not in {m.name for m in handed[-1] or []} and len(handed[-1] or []) == 1000
    watch._apply({"type": "MODIFIED", "object": model("m6", generation=2, scaling={"min": 1})})
    assert next(m for m in handed[-1] or [] if m.name == "m6").spec.scaling.min == 1
    assert walks == []
