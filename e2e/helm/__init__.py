"""Helm for the chart tests: the `helm` tool of e2e.tools, under the names the tests use.

`python -m e2e.helm` builds (or reuses) e2e/.bin/helm from the pin in
e2e/tools/go/helm/go.mod; tests/chart/ and e2e/test_helm.py call `ensure_helm()`.
"""

from __future__ import annotations

from pathlib import Path

from e2e.build import BuildError as BuildError
from e2e.build import Log
from e2e.tools import TOOLS, _log

TOOL = TOOLS["helm"]
HELM = TOOL.binary
STAMP = TOOL.stamp


def is_current() -> bool:
    return TOOL.is_current()


def ensure_helm(force: bool = False, log: Log = _log) -> Path:
    """Build helm unless its stamp matches the pins; returns its path."""
    return TOOL.ensure(force, log)
