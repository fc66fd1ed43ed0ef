"""Bearer-token API keys: the per-request key check of the decided path.

The key file (format, scopes, rotation: wakegate/keyfile.py) is shared with `wakegate up`'s
feeder, which gives the same keys to Envoy's native routes.

A request is allowed when it carries ``Authorization: Bearer <key>`` (scheme case-insensitive,
one or more spaces before the token) for any key in the file. Only SHA-256 digests of the keys are
kept in memory, and every check compares the token's digest with *every* stored digest using
:func:`hmac.compare_digest` without stopping early, so the time taken does not reveal which key
matched or how many keys there are close to the token.

Rotation without restart: :meth:`ApiKeys.check` stats the file at most once per
``reload_interval`` seconds (by the injected clock) and re-reads it when it changed; a file that
vanishes or becomes unreadable later keeps the previous keys (:class:`wakegate.keyfile.KeyFile`).
Keys and tokens are never logged; logs name the file and count its keys.

Hot path cost: one SHA-256 of the token plus one constant-time compare per key; at most one
``stat`` per ``reload_interval``. Single-threaded asyncio use; no locks.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Callable
from pathlib import Path

from wakegate.keyfile import ALL_MODELS, RELOAD_INTERVAL, AuthConfigError, KeyFile, Scope, parse_entries

__all__ = ["ALL_MODELS", "ApiKeys", "AuthConfigError", "Scope", "parse_keys"]

log = logging.getLogger(__name__)

_Entries = tuple[tuple[bytes, Scope], ...]


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


def parse_keys(text: str) -> tuple[_Entries, list[int]]:
    """``(digest, scope)`` per distinct key in ``text`` (order kept) and the numbers of bad lines.

    Pure: the caller logs the bad line numbers (never their contents, which hold keys).
    """
    return parse_entries(text, _digest)


class ApiKeys:
    """The set of accepted API keys, reloaded from ``path`` when the file changes.

    ``path=None`` switches auth off: :attr:`enabled` is False and :meth:`check` allows everything.
    """

    def __init__(
        self,
        path: Path | None,
        *,
        reload_interval: float = RELOAD_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not reload_interval >= 0:  # also rejects NaN
            raise ValueError(f"reload_interval must be >= 0, got {reload_interval!r}")
        self._file = (
            None if path is None else KeyFile(path, _digest, log, reload_interval=reload_interval, clock=clock)
        )

    @property
    def enabled(self) -> bool:
        """False when no key file was configured (auth off: everything allowed)."""
        return self._file is not None

    @property
    def key_count(self) -> int:
        """How many distinct keys are currently accepted."""
        return 0 if self._file is None else len(self._file.entries)

    def check(self, authorization: str | None) -> bool:
        """True when ``authorization`` is ``Bearer <token>`` for an accepted key (or auth is off)."""
        return self.scope(authorization) is not None

    def scope(self, authorization: str | None) -> Scope | None:
        """The models ``authorization`` may use; None when it is refused (:data:`ALL_MODELS` when auth is off)."""
        if self._file is None:
            return ALL_MODELS
        self._file.poll()
        token = _bearer_token(authorization)
        if token is None:
            return None
        candidate = _digest(token)
        found: Scope | None = None
        for digest, scope in self._file.entries:
            # Every digest is compared, whatever matched before; a match only picks its scope.
            if hmac.compare_digest(digest, candidate):
                found = scope
        return found

    def reload_if_changed(self) -> None:
        """Stat the key file and re-read it if its (mtime_ns, size, inode) changed.

        :meth:`check` calls this at most once per ``reload_interval``; calling it directly (for
        example on SIGHUP) always stats. Never raises: on failure the previous keys stay.
        """
        if self._file is not None:
            self._file.reload_if_changed()


def _bearer_token(authorization: str | None) -> str | None:
    """The token of ``Bearer <token>``; None for anything else (other scheme, empty token, ...)."""
    if not authorization:
        return None
    scheme, sep, rest = authorization.partition(" ")
    if not sep or scheme.lower() != "bearer":
        return None
    token = rest.lstrip(" ").rstrip()
    if not token or any(ch.isspace() for ch in token):
        return None
    return token
