"""A discovery that reads its GPUs from a JSON file, for tests and demos without hardware.

The file is an object: node name -> list of devices, `"*"` for any other node; a device is
``{"vendor", "arch", "name", "total_mb", "free_mb", "utilization"}``. It is re-read on every
call, so a test changes what the agent sees by rewriting the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from wakegate.control.gpu.discovery import DiscoveryError, GpuDevice


def _device(raw: Any) -> GpuDevice:
    if not isinstance(raw, dict):
        raise DiscoveryError(f"fake GPU entry is not an object: {raw!r}")
    entry: dict[str, Any] = raw
    try:
        return GpuDevice(
            vendor=str(entry["vendor"]),
            arch=str(entry["arch"]),
            name=str(entry.get("name", "fake GPU")),
            total_mb=int(entry["total_mb"]),
            free_mb=int(entry.get("free_mb", entry["total_mb"])),
            utilization=float(entry.get("utilization", 0.0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DiscoveryError(f"fake GPU entry {raw!r}: {exc!r}") from None


class FakeDiscovery:
    name = "fake"

    def __init__(self, path: Path, node: str) -> None:
        self.path = path
        self.node = node

    def devices(self) -> list[GpuDevice]:
        try:
            table = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            raise DiscoveryError(f"cannot read {self.path}: {exc}") from None
        if not isinstance(table, dict):
            raise DiscoveryError(f"{self.path}: expected an object of node name -> devices")
        entries = table.get(self.node, table.get("*", []))
        if not isinstance(entries, list):
            raise DiscoveryError(f"{self.path}: devices of {self.node} are not a list")
        return [_device(raw) for raw in entries]

    def close(self) -> None:
        return
