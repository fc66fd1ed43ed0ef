"""`wakegate up -f FILE`: the whole gateway and its models on one machine.

Starts, in order: the xDS feeder, two extprocs (active and standby), Envoy (each its own
process, restarted if it dies), then one backend process per replica of every model with
`spec.scaling.min >= 1`. Invalid files and a taken gateway port fail before anything
starts. The first SIGINT/SIGTERM drains (Envoy stops accepting, requests in flight finish)
and stops every child; a second one exits at once. Children die with this process even if
it is SIGKILLed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from pathlib import Path

from wakegate.control import bootstrap
from wakegate.control.backends import BACKENDS
from wakegate.control.delivery.cache import default_cache_dir
from wakegate.control.delivery.console import old_spelling, size_argument
from wakegate.control.delivery.resolver import Verify
from wakegate.control.up.settings import Settings
from wakegate.control.up.supervisor import Up
from wakegate.control.up.weights import default_flash_dir
from wakegate.gateway_flags import add_request_arguments
from wakegate.process import add_log_level, start

log = logging.getLogger("wakegate.up")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--file", type=Path, help="YAML file of Model documents")
    parser.add_argument("--listen", default="127.0.0.1:8080", help="gateway address HOST:PORT")
    parser.add_argument(
        "--admin-listen",
        default="127.0.0.1:8081",
        help="HTTP address for /status (models, replicas, ports) and /healthz",
    )
    parser.add_argument(
        "--envoy-admin-listen",
        default=None,
        metavar="HOST:PORT",
        help="serve Envoy's admin API on this TCP address (anyone who can connect can stop the gateway); "
        "default: an owner-only Unix socket in the state dir",
    )
    parser.add_argument("--state-dir", type=Path, default=Path(".wakegate"), help="logs and rendered configs")
    add_request_arguments(parser, metrics_elsewhere="on --admin-listen at /metrics/gateway")
    parser.add_argument("--envoy-concurrency", type=int, default=2, help="Envoy worker threads")
    parser.add_argument(
        "--extproc-h2-limit",
        action="append",
        default=[],
        type=_name_value,
        metavar="NAME=VALUE",
        help="a limit of extproc's HTTP/2 server, passed on as `wakegate extproc --h2-limit` (repeatable)",
    )
    parser.add_argument(
        "--upstream-header",
        action="store_true",
        help="add x-wakegate-upstream (the backend's ip:port) to responses, for debugging",
    )
    parser.add_argument(
        "--status-display",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="live status table on the terminal (default: when stderr is a terminal)",
    )
    parser.add_argument(
        "--keepalive-seconds",
        type=float,
        default=2.0,
        help="SSE heartbeat interval for cold requests of keepalive models",
    )
    parser.add_argument(
        "--scaler-listen",
        default=None,
        metavar="HOST:PORT",
        help="also serve KEDA's ExternalScaler gRPC service for these models (the protocol without a cluster)",
    )
    parser.add_argument(
        "--fake-gpus", type=Path, default=None, help="JSON file of GPUs to pretend this machine has (tests and demos)"
    )
    weights = parser.add_argument_group(
        "weights", "where oci:// and hf:// sources are cached, and how registries are reached"
    )
    weights.add_argument(
        "--cache-dir",
        type=Path,
        default=default_cache_dir(),
        help="this machine's model cache, shared with `wakegate cache` "
        "(default: $WAKEGATE_CACHE_DIR, else $XDG_CACHE_HOME/wakegate/models, else ~/.cache/wakegate/models)",
    )
    weights.add_argument(
        "--cache-max-size",
        type=size_argument,
        default=None,
        metavar="SIZE",
        help="cache budget (e.g. 20G); least recently used entries no engine uses are evicted to stay under it "
        "(default: the file system's free space)",
    )
    weights.add_argument(
        "--cache-verify",
        choices=[v.value for v in Verify],
        default=Verify.BLOCKS.value,
        help="check of a cached entry before each engine start: blocks (every block's digest, default) or sizes",
    )
    weights.add_argument(
        "--registry-config",
        type=Path,
        default=None,
        metavar="FILE",
        help="Docker config with registry credentials (`auths`); default $DOCKER_CONFIG/config.json, "
        "then ~/.docker/config.json",
    )
    ca = weights.add_argument(
        "--registry-ca-file", dest="ca_file", type=Path, default=None, metavar="PEM",
        help="extra CA certificates for registries",
    )
    old_spelling(weights, "--ca-file", ca)
    weights.add_argument(
        "--plain-http", action="store_true", help="plain HTTP to every registry (loopback ones need no flag)"
    )
    weights.add_argument(
        "--flash-dir",
        type=Path,
        default=default_flash_dir(),
        help="where `spec.cache.flash: true` stages weights (a tmpfs; default: a folder of yours in /dev/shm)",
    )
    parser.add_argument("--check", action="store_true", help="validate the file and exit")
    parser.add_argument("--list-backends", action="store_true", help="print the backend plugins and exit")
    add_log_level(parser)


def _name_value(text: str) -> str:
    """argparse type of `--extproc-h2-limit`: NAME=NUMBER (extproc checks the name and range)."""
    name, sep, value = text.partition("=")
    try:
        float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=NUMBER") from None
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=NUMBER")
    return text


def main(args: argparse.Namespace) -> int:
    if args.list_backends:
        for backend in BACKENDS.values():
            vendors = ",".join(backend.gpu_vendors) or "none"
            print(f"{backend.name:10} port={backend.default_port:<6} gpu={vendors:12} {backend.description}")
            print(f"{'':10} load signal: {backend.load_signal}")
        return 0
    return start(args, Settings.from_args, _check if args.check else run, "up")


def _check(settings: Settings) -> int:
    print(f"{settings.file}: {len(settings.models)} model(s) valid")
    return 0


def run(settings: Settings) -> int:
    bootstrap.raise_nofile()  # Envoy's client connections are capped by what it inherits
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    return asyncio.run(Up(settings).run())
