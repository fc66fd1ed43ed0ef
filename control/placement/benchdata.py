"""Bench results as stored in the results ConfigMap, and the key the extender looks them up by.

One ConfigMap (default `wakegate-bench-results` in the release namespace) holds every result:
key = SHA-256 hex of ``backend|model|deviceClass``, value = a JSON object with
``tokens_per_second``, ``ttft_ms``, ``measured_at`` and, for people reading it, the three
key parts. ConfigMap keys allow only ``[-._a-zA-Z0-9]``, hence the hash.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from wakegate.control.placement.facts import number

DEFAULT_CONFIGMAP = "wakegate-bench-results"


def result_key(backend: str, model: str, device_class: str) -> str:
    return hashlib.sha256(f"{backend}|{model}|{device_class}".encode()).hexdigest()


@dataclass(frozen=True)
class BenchResult:
    backend: str
    model: str
    device_class: str
    tokens_per_second: float
    ttft_ms: float
    measured_at: str
    concurrency: int = 1
    requests: int = 0

    @property
    def key(self) -> str:
        return result_key(self.backend, self.model, self.device_class)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def tokens_per_second(value: str) -> float | None:
    """The throughput stored in one ConfigMap value; None when the value is unusable."""
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):
        return None
    if not isinstance(parsed, dict):
        return None
    return number(parsed.get("tokens_per_second"))


def throughput_table(data: Mapping[str, str] | None) -> dict[str, float]:
    """ConfigMap data -> key -> tokens/s, skipping unusable entries."""
    table: dict[str, float] = {}
    for key, value in (data or {}).items():
        tps = tokens_per_second(value) if isinstance(value, str) else None
        if tps is not None:
            table[key] = tps
    return table
