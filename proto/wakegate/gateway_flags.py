"""The flags that say how the gateway decides each request (keys, public metrics, fair-share
header, body limit, gateway-wide rate), declared once: `wakegate extproc` takes them, and
`wakegate up` takes the same ones and passes them on to the extprocs it starts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

#: What GET /metrics on the gateway's public listener does: 404, open to anyone, or any valid key.
PUBLIC_METRICS = ("off", "open", "keys")
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


def add_request_arguments(parser: argparse.ArgumentParser, *, metrics_elsewhere: str) -> None:
    """`--api-keys-file`, `--public-metrics`, `--fairness-header`, `--max-body-bytes`, `--global-rps`
    and `--global-burst`; `metrics_elsewhere` says where the gateway's metrics are when the public
    listener does not serve them."""
    parser.add_argument(
        "--api-keys-file",
        type=Path,
        default=None,
        help="API keys, one per line, each optionally followed by the models it may use (`KEY model-a,model-b`); "
        "re-read on change (auth off if unset)",
    )
    parser.add_argument(
        "--public-metrics",
        choices=PUBLIC_METRICS,
        default="off",
        help="GET /metrics on the gateway's public listener: off (404), open, or keys (any valid API key); "
        f"the gateway's metrics are always {metrics_elsewhere}",
    )
    parser.add_argument(
        "--fairness-header",
        action="store_true",
        help="flow control: a request whose API key names no tenant is fair-shared as the tenant its "
        "x-gateway-inference-fairness-id header names (otherwise: the default tenant)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body the gateway reads to find `model`, bytes",
    )
    parser.add_argument("--global-rps", type=float, default=0.0, help="requests/s over all models; 0: unlimited")
    parser.add_argument("--global-burst", type=float, default=0.0, help="burst of --global-rps; 0: max(1, rps)")
