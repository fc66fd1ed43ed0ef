"""Bearer-token API keys: owns the key file, its rotation, and the per-request key check.

Key file format (UTF-8 text)::

    # comments start with '#'; blank lines are ignored
    sk-team-a-0123456789
    sk-team-b-abcdefghij

One key per line; whitespace around a key is stripped. A key containing whitespace can never
match a bearer token (tokens have none), so such lines are reported (by line number) and skipped.
There is no ``name:key`` syntax: the whole stripped line is the key. An empty key file (no keys)
means nobody is allowed.

A request is allowed when it carries ``Authorization: Bearer <key>`` (scheme case-insensitive,
one or more spaces before the token) for any key in the file. Only SHA-256 digests of the keys are
kept in memory, and every check compares the token's digest with *every* stored digest using
:func:`hmac.compare_digest` without stopping early, so the time taken does not reveal which key
matched or how many keys there are close to the token.

Rotation without restart: :meth:`ApiKeys.check` stats the file at most once per
``reload_interval`` seconds (by the injected clock) and re-reads it when its
``(mtime_ns, size, inode)`` changed. If the file vanishes or becomes unreadable later, the
previous keys stay in force and a warning is logged once per distinct problem. Keys and tokens are
never logged; logs name the file and count its keys.

Hot path cost: one SHA-256 of the token plus one constant-time compare per key; at most one
``stat`` per ``reload_interval``. Single-threaded asyncio use; no locks.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["ApiKeys", "AuthConfigError"]

log = logging.getLogger(__name__)

_Fingerprint = tuple[int, int, int]


class AuthConfigError(ValueError):
    """The key file given at startup is missing, unreadable or not UTF-8."""


def _stat(path: Path) -> os.stat_result:
    """``os.stat``; a separate function so tests can count the calls."""
    return os.stat(path)


def _fingerprint(st: os.stat_result) -> _Fingerprint:
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


def _parse(text: str, path: Path) -> tuple[bytes, ...]:
    """Digests of the keys in ``text`` (duplicates collapsed, order kept)."""
    digests: dict[bytes, None] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        key = raw.strip()
        if not key or key.startswith("#"):
            continue
        if any(ch.isspace() for ch in key):
            log.warning("key file %s line %d contains whitespace inside the key; it is ignored", path, lineno)
            continue
        digests[_digest(key)] = None
    return tuple(digests)


def _read(path: Path) -> tuple[_Fingerprint, tuple[bytes, ...]]:
    """Read and parse the key file. Raises OSError or UnicodeDecodeError."""
    with open(path, "rb") as f:
        # fstat of the open file: the fingerprint belongs to exactly the bytes we read, even if
        # the path is swapped (atomic rename) right now. A later change is seen on the next stat.
        fp = _fingerprint(os.fstat(f.fileno()))
        data = f.read()
    return fp, _parse(data.decode("utf-8"), path)


def _describe(exc: BaseException) -> str:
    """A log-safe description of a read failure (never includes file contents)."""
    if isinstance(exc, UnicodeDecodeError):
        return "not valid UTF-8"
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__
    return type(exc).__name__


class ApiKeys:
    """The set of accepted API keys, reloaded from ``path`` when the file changes.

    ``path=None`` switches auth off: :attr:`enabled` is False and :meth:`check` allows everything.
    """

    def __init__(
        self,
        path: Path | None,
        *,
        reload_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not reload_interval >= 0:  # also rejects NaN
            raise ValueError(f"reload_interval must be >= 0, got {reload_interval!r}")
        self._path = path
        self._reload_interval = reload_interval
        self._clock = clock
        self._digests: tuple[bytes, ...] = ()
        self._fp: _Fingerprint | None = None
        self._problem: str | None = None  # last logged reload problem, to log each one once
        if path is None:
            self._last_stat = clock()
            return
        try:
            self._fp, self._digests = _read(path)
        except (OSError, UnicodeDecodeError) as exc:
            raise AuthConfigError(f"cannot read API key file {path}: {_describe(exc)}") from None
        self._log_loaded("loaded")
        self._last_stat = clock()

    @property
    def enabled(self) -> bool:
        """False when no key file was configured (auth off: everything allowed)."""
        return self._path is not None

    @property
    def key_count(self) -> int:
        """How many distinct keys are currently accepted."""
        return len(self._digests)

    def check(self, authorization: str | None) -> bool:
        """True when ``authorization`` is ``Bearer <token>`` for an accepted key (or auth is off)."""
        if self._path is None:
            return True
        now = self._clock()
        if now - self._last_stat >= self._reload_interval or now < self._last_stat:
            self._last_stat = now
            self.reload_if_changed()
        token = _bearer_token(authorization)
        if token is None:
            return False
        candidate = _digest(token)
        matched = False
        for digest in self._digests:
            # Bitwise OR, not `or`: every digest is compared, whatever matched before.
            matched |= hmac.compare_digest(digest, candidate)
        return matched

    def reload_if_changed(self) -> None:
        """Stat the key file and re-read it if its (mtime_ns, size, inode) changed.

        :meth:`check` calls this at most once per ``reload_interval``; calling it directly (for
        example on SIGHUP) always stats. Never raises: on failure the previous keys stay.
        """
        path = self._path
        if path is None:
            return
        try:
            fp = _fingerprint(_stat(path))
        except OSError as exc:
            self._report(f"cannot stat: {_describe(exc)}")
            return
        if fp == self._fp and self._problem is None:
            return
        # Changed, or the last attempt failed (then retry: a chmod fixes the file without
        # changing its fingerprint).
        try:
            new_fp, digests = _read(path)
        except (OSError, UnicodeDecodeError) as exc:
            self._report(f"cannot read: {_describe(exc)}")
            return
        self._problem = None
        if new_fp == self._fp and digests == self._digests:
            return
        self._fp, self._digests = new_fp, digests
        self._log_loaded("reloaded")

    def _report(self, problem: str) -> None:
        if problem != self._problem:
            self._problem = problem
            log.warning("API key file %s %s; keeping the previous %d keys", self._path, problem, len(self._digests))

    def _log_loaded(self, verb: str) -> None:
        n = len(self._digests)
        if n == 0:
            log.warning("key file %s %s: 0 keys; every request will be refused", self._path, verb)
        else:
            log.info("key file %s %s: %d keys", self._path, verb, n)


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
