"""Bearer-token API keys: owns the key file, its rotation, and the per-request key check.

Key file format (UTF-8 text)::

    # comments start with '#'; blank lines are ignored
    sk-team-a-0123456789
    sk-team-b-abcdefghij   chat-small, chat-large
    sk-team-c-klmnopqrst   *

A line is a key, optionally followed by whitespace and the comma-separated models that key may
use (its *scope*). A key alone on its line (the simple, gateway-wide form) may use every model,
and so may a key scoped to ``*``. A scope names a model by its key (``name`` for ``wakegate up``,
``namespace/name`` on Kubernetes) or by its own name (the Model's ``metadata.name``); aliases,
served names and adapters are not scope entries: a request naming them is checked against the
model they resolve to. A key listed on several lines may use the union of their scopes.

Tokens never contain whitespace, so a key ends at the first whitespace: every line of a plain
key-per-line file still means what it meant (a key for every model). A line whose scope is not a
list of model names (an empty entry, whitespace inside a name) is reported by line number, never
with its contents, and skipped. An empty key file (no keys) means nobody is allowed.

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
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ALL_MODELS", "ApiKeys", "AuthConfigError", "Scope", "parse_keys"]

log = logging.getLogger(__name__)

_Fingerprint = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class Scope:
    """The models one key may use; ``models=None``: every model."""

    models: frozenset[str] | None = None

    def allows(self, key: str, name: str) -> bool:
        """Whether the model with this route key and own name is in the scope."""
        return self.models is None or key in self.models or name in self.models

    def union(self, other: Scope) -> Scope:
        if self.models is None or other.models is None:
            return ALL_MODELS
        return Scope(self.models | other.models)


#: The scope of a gateway-wide key (and of every request when auth is off).
ALL_MODELS = Scope()

_Entries = tuple[tuple[bytes, Scope], ...]


class AuthConfigError(ValueError):
    """The key file given at startup is missing, unreadable or not UTF-8."""


def _stat(path: Path) -> os.stat_result:
    """``os.stat``; a separate function so tests can count the calls."""
    return os.stat(path)


def _fingerprint(st: os.stat_result) -> _Fingerprint:
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


def _scope(text: str) -> Scope | None:
    """The scope after a key (``"a, b"``, ``"*"``); None when it is not a list of model names."""
    names = [entry.strip() for entry in text.split(",")]
    if any(not entry or any(ch.isspace() for ch in entry) for entry in names):
        return None
    return ALL_MODELS if "*" in names else Scope(frozenset(names))


def parse_keys(text: str) -> tuple[_Entries, list[int]]:
    """``(digest, scope)`` per distinct key in ``text`` (order kept) and the numbers of bad lines.

    Pure: the caller logs the bad line numbers (never their contents, which hold keys).
    """
    scopes: dict[bytes, Scope] = {}
    bad: list[int] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, rest = _split_ws(line)
        scope = _scope(rest) if rest else ALL_MODELS
        if scope is None:
            bad.append(lineno)
            continue
        digest = _digest(key)
        known = scopes.get(digest)
        scopes[digest] = scope if known is None else known.union(scope)
    return tuple(scopes.items()), bad


def _split_ws(line: str) -> tuple[str, str]:
    """A stripped line split at its first whitespace character of any kind (tab, ...)."""
    for i, ch in enumerate(line):
        if ch.isspace():
            return line[:i], line[i + 1 :].strip()
    return line, ""


def _parse(text: str, path: Path) -> _Entries:
    entries, bad = parse_keys(text)
    for lineno in bad:
        log.warning(
            "key file %s line %d: after the key, expected whitespace and model names separated by commas "
            "(or *); the line is ignored",
            path,
            lineno,
        )
    return entries


def _read(path: Path) -> tuple[_Fingerprint, _Entries]:
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
        self._entries: _Entries = ()
        self._fp: _Fingerprint | None = None
        self._problem: str | None = None  # last logged reload problem, to log each one once
        if path is None:
            self._last_stat = clock()
            return
        try:
            self._fp, self._entries = _read(path)
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
        return len(self._entries)

    def check(self, authorization: str | None) -> bool:
        """True when ``authorization`` is ``Bearer <token>`` for an accepted key (or auth is off)."""
        return self.scope(authorization) is not None

    def scope(self, authorization: str | None) -> Scope | None:
        """The models ``authorization`` may use; None when it is refused (:data:`ALL_MODELS` when auth is off)."""
        if self._path is None:
            return ALL_MODELS
        now = self._clock()
        if now - self._last_stat >= self._reload_interval or now < self._last_stat:
            self._last_stat = now
            self.reload_if_changed()
        token = _bearer_token(authorization)
        if token is None:
            return None
        candidate = _digest(token)
        found: Scope | None = None
        for digest, scope in self._entries:
            # Every digest is compared, whatever matched before; a match only picks its scope.
            if hmac.compare_digest(digest, candidate):
                found = scope
        return found

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
            new_fp, entries = _read(path)
        except (OSError, UnicodeDecodeError) as exc:
            self._report(f"cannot read: {_describe(exc)}")
            return
        self._problem = None
        if new_fp == self._fp and entries == self._entries:
            return
        self._fp, self._entries = new_fp, entries
        self._log_loaded("reloaded")

    def _report(self, problem: str) -> None:
        if problem != self._problem:
            self._problem = problem
            log.warning("API key file %s %s; keeping the previous %d keys", self._path, problem, len(self._entries))

    def _log_loaded(self, verb: str) -> None:
        n = len(self._entries)
        if n == 0:
            log.warning("key file %s %s: 0 keys; every request will be refused", self._path, verb)
        else:
            scoped = sum(1 for _, scope in self._entries if scope.models is not None)
            log.info("key file %s %s: %d keys (%d scoped to some models)", self._path, verb, n, scoped)


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
