"""What every long-running `wakegate` process shares: its logging set-up and its graceful exit.

Logging: one format on stderr, one `--log-level` flag that takes DEBUG, INFO, WARNING or
ERROR in any case (WARN too). Exit: SIGTERM or SIGINT sets the process's stop event (stop
admitting, finish what is in flight, then exit); another one while draining ends the
process at once with status 130.

Lines caused by what clients send go through a `ThrottledLog`: at most a few per second per
kind, the rest counted, so no client can flood a log.

Both halves (wakegate.control, wakegate.extproc) use this module; it imports neither.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Self, TypeVar

log = logging.getLogger("wakegate")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
#: Exit status of a process stopped by a second signal while it drained.
FORCED_EXIT = 130
#: Exit status of a command line that cannot be used.
USAGE_ERROR = 2

_Settings = TypeVar("_Settings")


@dataclass(frozen=True, kw_only=True)
class ProcessSettings:
    """What the settings of every process have; each process's `Settings` adds its own fields."""

    log_level: str = "INFO"
    """DEBUG, INFO, WARNING or ERROR."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Self:
        """The settings from parsed arguments (every field from the argument of its name).

        Subclasses that derive or check values override this; a ValueError is a usage error.
        """
        return settings_from(cls, args)


def start(
    args: argparse.Namespace,
    settings: Callable[[argparse.Namespace], _Settings],
    run: Callable[[_Settings], int],
    name: str,
    *,
    quiet: Iterable[str] = (),
) -> int:
    """The shape of every process's main: set logging up, build its one settings object, run it.

    A ValueError while building the settings is a usage error: one line on stderr, status 2.
    """
    setup_logging(args.log_level, quiet=quiet)
    try:
        built = settings(args)
    except ValueError as exc:
        print(f"wakegate {name}: {exc}", file=sys.stderr, flush=True)
        return USAGE_ERROR
    return run(built)


def settings_from(cls: type[_Settings], args: argparse.Namespace, **given: Any) -> _Settings:
    """A settings dataclass from parsed arguments: every field not `given` is the argument of its name."""
    names = {field.name for field in dataclasses.fields(cls)}  # type: ignore[arg-type]
    taken = {name: getattr(args, name) for name in names - given.keys() if hasattr(args, name)}
    return cls(**taken, **given)


def host_port(address: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """`HOST:PORT` (IPv6 in brackets; an empty host means `default_host`); ValueError otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host.strip("[]") or default_host, int(port)


def log_level(text: str) -> str:
    """argparse type of `--log-level`: a level name in any case."""
    level = text.strip().upper()
    level = "WARNING" if level == "WARN" else level
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(LOG_LEVELS)}")
    return level


def add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level", type=log_level, default="INFO", metavar="LEVEL", help=f"one of {', '.join(LOG_LEVELS)}"
    )


def setup_logging(level: str, *, quiet: Iterable[str] = ()) -> None:
    """Log to stderr at `level`; loggers named in `quiet` (chatty libraries) only from WARNING."""
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)
    for name in quiet:
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLevelName(level)))


class ThrottledLog:
    """One line per event, at most `per_second` lines per second for each kind; the rest counted.

    A kind is a short fixed token (an error code, not client text). The lines a kind lost
    are counted and the count rides on that kind's next line ("+N suppressed"). At most
    `max_kinds` kinds are tracked; past that the table starts over (counts may be lost, lines never
    exceed the bound by more than one window's worth).
    """

    def __init__(
        self,
        logger: logging.Logger,
        per_second: int = 5,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_kinds: int = 1024,
    ) -> None:
        self.logger = logger
        self.per_second = per_second
        self._clock = clock
        self._max_kinds = max_kinds
        #: kind -> [window start, lines written in it, lines suppressed since the last written]
        self._kinds: dict[str, list[float]] = {}

    def log(self, level: int, kind: str, message: str, *args: object) -> bool:
        """Write the line unless `kind` has had its share this second; True when written."""
        if not self.logger.isEnabledFor(level):
            return False
        now = self._clock()
        state = self._kinds.get(kind)
        if state is None:
            if len(self._kinds) >= self._max_kinds:
                self._kinds.clear()
            state = self._kinds[kind] = [now, 0, 0]
        elif now - state[0] >= 1.0:
            state[0], state[1] = now, 0
        if state[1] >= self.per_second:
            state[2] += 1
            return False
        state[1] += 1
        suppressed, state[2] = int(state[2]), 0
        if suppressed:
            self.logger.log(level, message + " (+%d suppressed)", *args, suppressed)
        else:
            self.logger.log(level, message, *args)
        return True


def graceful_exit(stop: asyncio.Event | threading.Event, name: str) -> None:
    """Wire SIGTERM/SIGINT to `stop`: an asyncio event from inside its loop, or a threading event
    from the main thread (processes whose work runs in threads)."""

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            log.warning("%s: second %s, exiting now", name, sig.name)
            logging.shutdown()
            os._exit(FORCED_EXIT)
        log.info("%s: %s received, draining", name, sig.name)
        stop.set()

    if isinstance(stop, asyncio.Event):
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: on_signal(signal.Signals(signum)))
