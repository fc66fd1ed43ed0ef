"""The internal token: how gateways authenticate to the xDS feeder (ADS) and to the demand service.

One secret per installation, shared by the parties of its internal gRPC channels: the
servers (`wakegate xds`, the demand service of `wakegate scaler`, `wakegate up`'s feeder)
and their clients (each gateway's Envoy and extproc). It never travels in a command line
or a log line: a process reads it from a file (`--internal-token-file`, re-read when the
file changes, so a rotated Secret applies without a restart) or from the environment
variable `WAKEGATE_INTERNAL_TOKEN` (how the chart hands a Secret to a container).

On the wire it is `authorization: Bearer <token>` from wakegate's own clients, or
`x-wakegate-token: <token>` from Envoy, whose credential injector sets a header to the
secret verbatim. Servers compare SHA-256 digests with `hmac.compare_digest`, so the time
taken says nothing about the token. A refused call is counted per service and logged in
one line at most every `LOG_INTERVAL` seconds.

Both halves use this module; it imports neither.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("wakegate.auth")

#: The environment variable a token may come from when no file is named.
ENV = "WAKEGATE_INTERNAL_TOKEN"
#: The header Envoy presents the token in (its credential injector writes a secret as is).
HEADER = "x-wakegate-token"
#: A file is stat'ed at most this often, seconds.
RELOAD_INTERVAL = 1.0
#: At most one log line per this many seconds about refused calls.
LOG_INTERVAL = 10.0


class TokenSource:
    """Where one process finds the internal token: a file, else the environment variable."""

    def __init__(
        self,
        file: Path | None,
        *,
        environ: dict[str, str] | os._Environ[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.file = file
        self._environ = os.environ if environ is None else environ
        self._clock = clock
        self._checked = -RELOAD_INTERVAL
        self._fingerprint: tuple[int, int, int] | None = None
        self._value: str | None = None

    def describe(self) -> str:
        """Where the token comes from, for a log line (never the token)."""
        return str(self.file) if self.file is not None else f"${ENV}"

    def value(self) -> str | None:
        """The token, or None when there is none (an empty file or variable is none)."""
        if self.file is None:
            return self._environ.get(ENV, "").strip() or None
        now = self._clock()
        if now - self._checked >= RELOAD_INTERVAL:
            self._checked = now
            try:
                st = os.stat(self.file)
                fingerprint = (st.st_mtime_ns, st.st_size, st.st_ino)
                if fingerprint != self._fingerprint:
                    self._value = self.file.read_text(encoding="utf-8").strip() or None
                    self._fingerprint = fingerprint
            except (OSError, UnicodeDecodeError) as exc:
                # Keep the token read last; a file that was never readable gives none.
                log.warning("cannot read the internal token file %s: %s", self.file, getattr(exc, "strerror", exc))
        return self._value

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """A client's call metadata: the bearer token, or nothing without one."""
        token = self.value()
        return (("authorization", f"Bearer {token}"),) if token else ()


def add_arguments(parser: argparse.ArgumentParser, *, server: bool) -> None:
    """`--internal-token-file` (and, for a server, `--no-internal-auth`)."""
    parser.add_argument(
        "--internal-token-file",
        type=Path,
        default=None,
        help=f"file holding the internal token (default: ${ENV})",
    )
    if server:
        parser.add_argument(
            "--no-internal-auth",
            action="store_true",
            help="accept gateways without the internal token (only on a network nothing else can reach)",
        )


def source_from(args: argparse.Namespace, *, server: bool) -> TokenSource | None:
    """The token source the arguments name; None for a server run with `--no-internal-auth`.

    Raises ValueError for a server that has no token and was not told to run without one:
    internal authentication is on by default.
    """
    if server and args.no_internal_auth:
        return None
    source = TokenSource(args.internal_token_file)
    if server and source.value() is None:
        raise ValueError(
            f"no internal token: give --internal-token-file or set ${ENV} "
            "(or run with --no-internal-auth on a network only gateways can reach)"
        )
    return source


def generate(path: Path) -> Path:
    """Create a random token in `path` (owner-only, in an owner-only folder) unless one is there; returns `path`."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(secrets.token_urlsafe(32) + "\n")
    os.chmod(path, 0o600)
    return path


def presented(metadata: Iterable[tuple[str, Any]] | None) -> str:
    """The token a call carries: `authorization: Bearer …`, else `x-wakegate-token`; "" for none."""
    bearer = header = ""
    for key, value in metadata or ():
        if not isinstance(value, str):
            continue
        if key == "authorization" and value[:7].lower() == "bearer ":
            bearer = value[7:].strip()
        elif key == HEADER:
            header = value.strip()
    return bearer or header


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class _Context(Protocol):
    def invocation_metadata(self) -> Any: ...

    def peer(self) -> str: ...


class Authenticator:
    """A server's check of the internal token on each call; counts what it refuses, per service."""

    def __init__(self, source: TokenSource, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.source = source
        self._clock = clock
        #: service ("ads", "demand") -> calls refused.
        self.refused: dict[str, int] = {}
        self._logged = -LOG_INTERVAL
        self._unlogged = 0

    def allows(self, context: _Context, service: str) -> bool:
        expected = self.source.value()
        token = presented(context.invocation_metadata())
        # Both digests are always computed and compared: the time does not depend on the token.
        ok = hmac.compare_digest(_digest(token), _digest(expected or "")) and bool(expected) and bool(token)
        if not ok:
            self.refused[service] = self.refused.get(service, 0) + 1
            self._log(context, service, "no" if not token else "wrong", expected is None)
        return ok

    def _log(self, context: _Context, service: str, kind: str, unconfigured: bool) -> None:
        now = self._clock()
        self._unlogged += 1
        if now - self._logged < LOG_INTERVAL:
            return
        self._logged = now
        more = f" ({self._unlogged} refused since the last line)" if self._unlogged > 1 else ""
        self._unlogged = 0
        reason = "no token configured on this server" if unconfigured else f"{kind} token"
        log.warning("refused unauthenticated %s call from %s: %s%s", service, context.peer(), reason, more)
