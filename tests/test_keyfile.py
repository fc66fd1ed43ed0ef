"""Tests for wakegate.keyfile as the feeder uses it: keys kept as written, and whether a look at
the file changed them (the feeder pushes a new route table only then). The format, rotation and
log hygiene are tested through extproc's ApiKeys (tests/extproc/test_auth.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from wakegate.keyfile import ALL_MODELS, AuthConfigError, KeyFile, Scope

log = logging.getLogger("test.keyfile")


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def write(path: Path, text: str, mtime_s: int) -> None:
    path.write_text(text, encoding="utf-8")
    os.utime(path, ns=(mtime_s * 1_000_000_000, mtime_s * 1_000_000_000))


def test_keys_as_written_and_a_change_reported_once(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    write(path, "sk-one-0000\nsk-two-1111  chat-a\n", 1)
    clock = Clock()
    keys = KeyFile(path, str, log, clock=clock)
    assert keys.entries == (("sk-one-0000", ALL_MODELS), ("sk-two-1111", Scope(frozenset({"chat-a"}))))
    write(path, "sk-three-2222\n", 2)
    assert keys.poll() is False  # not a second yet since the last look
    clock.now += 1.0
    assert keys.poll() is True
    assert keys.entries == (("sk-three-2222", ALL_MODELS),)
    assert keys.reload_if_changed() is False
    # Touched, same keys: nothing to push.
    write(path, "sk-three-2222\n", 3)
    assert keys.reload_if_changed() is False


def test_a_vanished_file_changes_nothing_and_a_missing_one_refuses_to_start(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    write(path, "sk-one-0000\n", 1)
    keys = KeyFile(path, str, log)
    path.unlink()
    assert keys.reload_if_changed() is False
    assert keys.entries == (("sk-one-0000", ALL_MODELS),)
    with pytest.raises(AuthConfigError, match="cannot read API key file"):
        KeyFile(tmp_path / "absent.txt", str, log)
