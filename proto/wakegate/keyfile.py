"""The API key file: its format, its parsing, and following it as it is rotated.

Both halves read the same file: extproc checks each decided request against it, and `wakegate
up`'s feeder hands the keys to Envoy for the native routes (docs/decisions.md, "The native
path"). One parser and one reload rule here keep the two from ever disagreeing about a file.

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

Flow control (extproc/flow.py) reads optional ``name=value`` attributes after the scope::

    sk-team-a-0123456789   chat-small   tenant=team-a band=critical weight=3 tokens-per-minute=200000

``tenant=`` is the fairness key of the key's requests (keys without one share the default tenant,
unless the gateway lets clients name theirs in a header), ``band=`` its priority band
(critical, standard or sheddable; default: the Model's), ``weight=`` the tenant's share among the
tenants of a band (default 1) and ``tokens-per-minute=`` its token budget (default: none). Weight
and budget belong to the tenant: its first key in the file decides, and a later key that sets other
values is reported by line number and skipped.

Tokens never contain whitespace, so a key ends at the first whitespace: every line of a plain
key-per-line file still means what it meant (a key for every model). A line whose scope is not a
list of model names (an empty entry, whitespace inside a name) is reported by line number, never
with its contents, and skipped. An empty key file (no keys) means nobody is allowed.

Rotation without restart: :meth:`KeyFile.poll` stats the file at most once per
``reload_interval`` seconds (by the injected clock) and re-reads it when its
``(mtime_ns, size, inode)`` changed. If the file vanishes or becomes unreadable later, the
previous keys stay in force and a warning is logged once per distinct problem. Keys are never
logged; logs name the file and count its keys.

What is kept of each key is the reader's choice (`store`): extproc keeps SHA-256 digests only,
the feeder the key itself (Envoy compares keys, not digests).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Generic, TypeVar

__all__ = ["ALL_MODELS", "RELOAD_INTERVAL", "AuthConfigError", "KeyFile", "Scope", "parse_entries"]

#: Seconds between two looks at the key file, at most (extproc's checks, the feeder's loop).
RELOAD_INTERVAL = 1.0

_T = TypeVar("_T")
_Fingerprint = tuple[int, int, int]


#: The key file's attribute names, and the bands `band=` takes (wakegate.contract.BANDS).
ATTRIBUTES = ("tenant", "band", "weight", "tokens-per-minute")
_BANDS = ("critical", "standard", "sheddable")


@dataclass(frozen=True, slots=True)
class Scope:
    """The models one key may use (``models=None``: every model), and its flow-control attributes."""

    models: frozenset[str] | None = None
    #: The tenant its requests are fair-shared as; empty: the gateway's default.
    tenant: str = ""
    #: Its priority band; empty: the Model's.
    band: str = ""
    #: The tenant's weight within a band.
    weight: float = 1.0
    #: The tenant's budget, prompt + completion tokens per minute; 0: none.
    tokens_per_minute: int = 0

    def allows(self, key: str, name: str) -> bool:
        """Whether the model with this route key and own name is in the scope."""
        return self.models is None or key in self.models or name in self.models

    def union(self, other: Scope) -> Scope:
        """Both scopes' models, with this one's attributes (a key's first line sets them)."""
        models = None if self.models is None or other.models is None else self.models | other.models
        union = replace(self, models=models)
        return ALL_MODELS if union == ALL_MODELS else union


#: The scope of a gateway-wide key (and of every request when auth is off).
ALL_MODELS = Scope()


class AuthConfigError(ValueError):
    """The key file given at startup is missing, unreadable or not UTF-8."""


def _stat(path: Path) -> os.stat_result:
    """``os.stat``; a separate function so tests can count the calls."""
    return os.stat(path)


def _fingerprint(st: os.stat_result) -> _Fingerprint:
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def _scope(text: str) -> Scope | None:
    """The scope and attributes after a key (``"a, b tenant=t"``, ``"*"``); None when it is not a
    list of model names followed by known ``name=value`` attributes."""
    words = text.split()
    first_attr = next((i for i, word in enumerate(words) if "=" in word), len(words))
    attrs: dict[str, str] = {}
    for word in words[first_attr:]:
        name, _, value = word.partition("=")
        if name not in ATTRIBUTES or not value or name in attrs:
            return None
        attrs[name] = value
    models: frozenset[str] | None = None
    if first_attr:
        names = [entry.strip() for entry in " ".join(words[:first_attr]).split(",")]
        if any(not entry or any(ch.isspace() for ch in entry) for entry in names):
            return None
        models = None if "*" in names else frozenset(names)
    band = attrs.get("band", "")
    if band and band not in _BANDS:
        return None
    try:
        weight = float(attrs.get("weight", "1"))
        budget = int(attrs.get("tokens-per-minute", "0"))
    except ValueError:
        return None
    if not 0 < weight <= 1000 or budget < 0:  # also rejects NaN
        return None
    scope = Scope(models, attrs.get("tenant", ""), band, weight, budget)
    return ALL_MODELS if scope == ALL_MODELS else scope


def parse_entries(text: str, store: Callable[[str], _T]) -> tuple[tuple[tuple[_T, Scope], ...], list[int]]:
    """``(store(key), scope)`` per distinct key in ``text`` (order kept) and the numbers of bad lines.

    Pure: the caller logs the bad line numbers (never their contents, which hold keys).
    """
    scopes: dict[_T, Scope] = {}
    bad: list[int] = []
    tenants: dict[str, Scope] = {}  # tenant -> the first key's attributes, which set its weight and budget
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, rest = _split_ws(line)
        scope = _scope(rest) if rest else ALL_MODELS
        if scope is None:
            bad.append(lineno)
            continue
        if scope.tenant:
            first = tenants.setdefault(scope.tenant, scope)
            if (first.weight, first.tokens_per_minute) != (scope.weight, scope.tokens_per_minute):
                if "weight=" in rest or "tokens-per-minute=" in rest:
                    bad.append(lineno)
                    continue
                scope = replace(scope, weight=first.weight, tokens_per_minute=first.tokens_per_minute)
        stored = store(key)
        known = scopes.get(stored)
        scopes[stored] = scope if known is None else known.union(scope)
    return tuple(scopes.items()), bad


def _split_ws(line: str) -> tuple[str, str]:
    """A stripped line split at its first whitespace character of any kind (tab, ...)."""
    for i, ch in enumerate(line):
        if ch.isspace():
            return line[:i], line[i + 1 :].strip()
    return line, ""


def _read(path: Path) -> tuple[_Fingerprint, str]:
    """The key file's fingerprint and text. Raises OSError or UnicodeDecodeError."""
    with open(path, "rb") as f:
        # fstat of the open file: the fingerprint belongs to exactly the bytes we read, even if
        # the path is swapped (atomic rename) right now. A later change is seen on the next stat.
        fp = _fingerprint(os.fstat(f.fileno()))
        data = f.read()
    return fp, data.decode("utf-8")


def _describe(exc: BaseException) -> str:
    """A log-safe description of a read failure (never includes file contents)."""
    if isinstance(exc, UnicodeDecodeError):
        return "not valid UTF-8"
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__
    return type(exc).__name__


class KeyFile(Generic[_T]):
    """The entries of one key file, re-read when it changes; each key kept as ``store(key)``.

    The constructor reads the file and raises :class:`AuthConfigError` when it cannot; later
    failures keep the previous entries. Log lines go to the reader's own logger.
    """

    def __init__(
        self,
        path: Path,
        store: Callable[[str], _T],
        log: logging.Logger,
        *,
        reload_interval: float = RELOAD_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not reload_interval >= 0:  # also rejects NaN
            raise ValueError(f"reload_interval must be >= 0, got {reload_interval!r}")
        self.path = path
        self._store = store
        self._log = log
        self._reload_interval = reload_interval
        self._clock = clock
        self._problem: str | None = None  # last logged reload problem, to log each one once
        try:
            self._fp, text = _read(path)
        except (OSError, UnicodeDecodeError) as exc:
            raise AuthConfigError(f"cannot read API key file {path}: {_describe(exc)}") from None
        self.entries = self._parse(text)
        self._log_loaded("loaded")
        self._last_stat = clock()

    def poll(self) -> bool:
        """:meth:`reload_if_changed`, at most once per ``reload_interval``; True when the entries changed."""
        now = self._clock()
        if now - self._last_stat >= self._reload_interval or now < self._last_stat:
            self._last_stat = now
            return self.reload_if_changed()
        return False

    def reload_if_changed(self) -> bool:
        """Stat the file and re-read it if its (mtime_ns, size, inode) changed; True when the
        entries changed. Never raises: on failure the previous entries stay."""
        try:
            fp = _fingerprint(_stat(self.path))
        except OSError as exc:
            self._report(f"cannot stat: {_describe(exc)}")
            return False
        if fp == self._fp and self._problem is None:
            return False
        # Changed, or the last attempt failed (then retry: a chmod fixes the file without
        # changing its fingerprint).
        try:
            new_fp, text = _read(self.path)
        except (OSError, UnicodeDecodeError) as exc:
            self._report(f"cannot read: {_describe(exc)}")
            return False
        self._problem = None
        entries = self._parse(text)
        if new_fp == self._fp and entries == self.entries:
            return False
        changed = entries != self.entries
        self._fp, self.entries = new_fp, entries
        self._log_loaded("reloaded")
        return changed

    def _parse(self, text: str) -> tuple[tuple[_T, Scope], ...]:
        entries, bad = parse_entries(text, self._store)
        for lineno in bad:
            self._log.warning(
                "key file %s line %d: after the key, expected whitespace and model names separated by commas "
                "(or *), then attributes tenant=, band= (critical, standard, sheddable), weight= (0 to 1000) "
                "and tokens-per-minute= (a tenant's weight and budget the same on each of its keys); the line "
                "is ignored",
                self.path,
                lineno,
            )
        return entries

    def _report(self, problem: str) -> None:
        if problem != self._problem:
            self._problem = problem
            self._log.warning("API key file %s %s; keeping the previous %d keys", self.path, problem, len(self.entries))

    def _log_loaded(self, verb: str) -> None:
        n = len(self.entries)
        if n == 0:
            self._log.warning("key file %s %s: 0 keys; every request will be refused", self.path, verb)
        else:
            scoped = sum(1 for _, scope in self.entries if scope.models is not None)
            self._log.info("key file %s %s: %d keys (%d scoped to some models)", self.path, verb, n, scoped)
