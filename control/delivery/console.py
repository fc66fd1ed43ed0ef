"""What the delivery commands (`wakegate cache`, `wakegate flash-load`) share on the command line:
the cache and registry options, and progress on a terminal or as plain lines.

On a terminal, progress is one line rewritten in place (bytes, rate, ETA). Anywhere else (a
log file, CI) it is plain lines: one per phase change and at most one every `PLAIN_INTERVAL`
seconds in between, and always the last.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from wakegate.control.delivery.cache import Cache, default_cache_dir, parse_size
from wakegate.control.delivery.progress import Phase, Progress
from wakegate.control.delivery.registry import RegistrySettings
from wakegate.control.delivery.resolver import Access
from wakegate.process import ProcessSettings

PLAIN_INTERVAL = 5.0
PROGRESS_MODES = ("auto", "tty", "plain", "none")


def size_argument(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def old_spelling(parser: argparse.ArgumentParser | argparse._ArgumentGroup, flag: str, action: argparse.Action) -> None:
    """`flag` as a hidden second spelling of `action`'s option, kept for a release after a rename
    (not in --help; it sets the same value and never a default of its own)."""
    parser.add_argument(flag, dest=action.dest, type=action.type or str, metavar=action.metavar,
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir(),
                        help="the model cache (default: $WAKEGATE_CACHE_DIR, else $XDG_CACHE_HOME/wakegate/models)")
    budget = parser.add_argument("--cache-max-size", dest="max_size", type=size_argument, default=None,
                                 metavar="SIZE",
                                 help="cache budget (e.g. 50G); least recently used entries not in use are evicted "
                                      "to stay under it (default: the file system's free space)")
    old_spelling(parser, "--max-size", budget)
    add_registry_arguments(parser)
    parser.add_argument("--progress", choices=PROGRESS_MODES, default="auto",
                        help="progress display; auto: a live line on a terminal, plain lines otherwise")


def add_registry_arguments(parser: argparse.ArgumentParser) -> None:
    """How registries are reached: credentials, CAs, plain HTTP."""
    parser.add_argument("--registry-config", type=Path, default=None, metavar="FILE",
                        help="Docker config with registry credentials (`auths`); default $DOCKER_CONFIG/config.json, "
                             "then ~/.docker/config.json")
    ca = parser.add_argument("--registry-ca-file", dest="ca_file", type=Path, default=None, metavar="PEM",
                             help="extra CA certificates trusted for registries")
    old_spelling(parser, "--ca-file", ca)
    parser.add_argument("--plain-http", action="store_true",
                        help="speak plain HTTP to registries (loopback registries without TLS need no flag)")


@dataclass(frozen=True, kw_only=True)
class RegistryOptions(ProcessSettings):
    """The registry options (`add_registry_arguments`)."""

    registry_config: Path | None
    """Docker config with registry credentials; None: the default places."""
    ca_file: Path | None
    """Extra CA certificates for registries."""
    plain_http: bool
    """Plain HTTP to every registry."""

    def registry_settings(self) -> RegistrySettings:
        return RegistrySettings(docker_config=self.registry_config, ca_file=self.ca_file, plain_http=self.plain_http)


@dataclass(frozen=True, kw_only=True)
class DeliverySettings(RegistryOptions):
    """The options every delivery command has (`add_cache_arguments`)."""

    cache_dir: Path
    """The model cache directory."""
    max_size: int | None
    """Cache budget in bytes; None: the file system's free space."""
    progress: str
    """auto, tty, plain or none."""

    def cache(self) -> Cache:
        return Cache(self.cache_dir, self.max_size)

    def access(self) -> Access:
        return Access.from_env(self.registry_settings())

    def printer(self) -> Printer:
        return Printer(self.progress)


class Printer:
    """A progress sink that prints to `stream`."""

    def __init__(self, mode: str = "auto", stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "tty" if self.stream.isatty() else "plain"
        self.mode = mode
        self._last_phase: Phase | None = None
        self._last_plain = 0.0
        self._live = False

    def __call__(self, event: Progress) -> None:
        if self.mode == "none":
            return
        final = event.phase in (Phase.READY, Phase.FAILED)
        if self.mode == "tty":
            self.stream.write("\r\x1b[2K" + event.line())
            self._live = True
            if final or event.phase is Phase.CORRUPT:
                self.stream.write("\n")
                self._live = False
            self.stream.flush()
            return
        now = time.monotonic()
        if event.phase is not self._last_phase or final or now - self._last_plain >= PLAIN_INTERVAL:
            self.stream.write(event.line() + "\n")
            self.stream.flush()
            self._last_plain = now
        self._last_phase = event.phase

    def close(self) -> None:
        if self._live:
            self.stream.write("\n")
            self.stream.flush()
            self._live = False
