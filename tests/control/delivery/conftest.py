"""Delivery tests run against the real Distribution registry and the real ORAS CLI (e2e/tools)."""

from __future__ import annotations

import os
from pathlib import Path

from tests.support.tools import oras_bin, registry_bin

__all__ = ["oras_bin", "registry_bin", "weights"]


def weights(directory: Path, size: int = 3 * 1024 * 1024 + 123, name: str = "tiny.gguf") -> Path:
    """A file of random bytes standing in for a GGUF (the registry and cache never look inside)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_bytes(os.urandom(size))
    return path
