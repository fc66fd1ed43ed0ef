"""Kubernetes as the feeder's source of truth: Models and backend EndpointSlices -> `RoutedModel`s.

Pure bookkeeping, no I/O: `KubeSource` records watch events (plain dicts) and
says what is routable. Endpoints are the ready addresses of the EndpointSlices
of a Model's backend Service (they carry the backend labels, copied from the
Service), with the slice's `http` port. `admitted` comes from the Model's
status (the operator sets it False for a GPU-group member that must wait);
`failed_activations` counts the times the Model entered phase Failed, so held
cold requests fail at once instead of waiting for their activation timeout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from wakegate.control.feeder.resources import RoutedModel, routed_model
from wakegate.control.k8s import names
from wakegate.control.k8s.objects import model_from_object


def slice_endpoints(body: Mapping[str, Any]) -> set[tuple[str, int]]:
    """Ready (ip, port) pairs of one EndpointSlice; `ready` absent means ready, as the API defines."""
    ports = [p for p in body.get("ports") or [] if p.get("port")]
    http = next((p for p in ports if p.get("name") == "http"), ports[0] if ports else None)
    if http is None:
        return set()
    out: set[tuple[str, int]] = set()
    for endpoint in body.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        if conditions.get("ready") is False or conditions.get("terminating") is True:
            continue
        for address in endpoint.get("addresses") or []:
            out.add((str(address), int(http["port"])))
    return out


@dataclass
class KubeSource:
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: model key -> slice name -> ready endpoints
    slices: dict[str, dict[str, set[tuple[str, int]]]] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    failed_now: dict[str, bool] = field(default_factory=dict)

    def on_model(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        meta = body["metadata"]
        key = names.model_key(meta["namespace"], meta["name"])
        if event_type == "DELETED":
            self.models.pop(key, None)
            self.failures.pop(key, None)
            self.failed_now.pop(key, None)
            return
        self.models[key] = {k: body.get(k) for k in ("apiVersion", "kind", "metadata", "spec", "status")}
        failed = ((body.get("status") or {}).get("phase")) == "Failed"
        if failed and not self.failed_now.get(key, False):
            self.failures[key] = self.failures.get(key, 0) + 1
        self.failed_now[key] = failed

    def on_slice(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        meta = body["metadata"]
        key = names.owning_model_key(meta)
        if key is None:
            return
        by_slice = self.slices.setdefault(key, {})
        if event_type == "DELETED":
            by_slice.pop(meta["name"], None)
        else:
            by_slice[meta["name"]] = slice_endpoints(body)

    def routed(self) -> list[RoutedModel]:
        out = []
        for key, body in sorted(self.models.items()):
            try:
                model = model_from_object(body)
            except ValidationError:
                continue
            status = body.get("status") or {}
            endpoints = set().union(*self.slices.get(key, {}).values())
            failed = self.failed_now.get(key, False)
            ready_message = next(
                (c.get("message", "") for c in status.get("conditions") or [] if c.get("type") == "Ready"), ""
            )
            out.append(
                routed_model(
                    model,
                    endpoints,
                    generation=int(body["metadata"].get("generation", 0)),
                    failed_activations=self.failures.get(key, 0),
                    last_failure=str(ready_message) if failed else "",
                    admitted=bool(status.get("admitted", True)),
                )
            )
        return out
