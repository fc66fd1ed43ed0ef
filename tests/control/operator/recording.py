"""The API server as the operator's reconciler sees it in tests that need no cluster: Secrets by
name, applies echoed and recorded, status patches recorded (the cluster tests are e2e's)."""

from __future__ import annotations

from typing import Any

from wakegate.control.k8s import names
from wakegate.control.k8s.client import KubeError


class RecordingKube:
    def __init__(self, secrets: dict[str, dict[str, Any]]) -> None:
        self.secrets = secrets
        self.applied: list[dict[str, Any]] = []
        #: (object path, status) per status patch
        self.patched: list[tuple[str, dict[str, Any]]] = []

    def get(self, resource: str) -> Any:
        name = resource.rsplit("/", 1)[-1]
        if "/secrets/" not in resource or name not in self.secrets:
            raise KubeError(404, "NotFound", "")
        return self.secrets[name]

    def get_or_none(self, resource: str) -> Any:
        return None

    def apply(self, obj: dict[str, Any], field_manager: str = names.FIELD_MANAGER, force: bool = True) -> Any:
        self.applied.append(obj)
        return obj

    def delete(self, resource: str) -> bool:
        return False

    def patch_status(self, obj_path: str, status: dict[str, Any]) -> Any:
        self.patched.append((obj_path, status))
        return {"status": status}
