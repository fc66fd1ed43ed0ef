"""Tests for wakegate.extproc.auth: bearer API keys, rotation, constant-time compare, log hygiene."""

from __future__ import annotations

import hmac
import logging
import os
import re
from pathlib import Path

import pytest

from wakegate import keyfile
from wakegate.extproc import auth
from wakegate.extproc.auth import ApiKeys, AuthConfigError

KEY_A = "sk-alpha-0123456789"
KEY_B = "sk-bravo-abcdefghij"
KEY_C = "sk-charlie-rotated-key"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


_mtime = 1_700_000_000_000_000_000


def write_keys(path: Path, text: str) -> None:
    """Write the key file and give it a fresh, distinct mtime (the FS clock may be coarse)."""
    global _mtime
    path.write_text(text, encoding="utf-8")
    _mtime += 1_000_000_000
    os.utime(path, ns=(_mtime, _mtime))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.txt"
    write_keys(path, f"{KEY_A}\n{KEY_B}\n")
    return path


@pytest.fixture
def stat_calls(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    calls: list[Path] = []
    real = keyfile._stat

    def counting(path: Path) -> os.stat_result:
        calls.append(path)
        return real(path)

    monkeypatch.setattr(keyfile, "_stat", counting)
    return calls


@pytest.fixture
def digest_compares(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per `hmac.compare_digest` call (the constant-time key check)."""
    calls: list[int] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    return calls


def test_disabled_allows_everything(clock: FakeClock) -> None:
    keys = ApiKeys(None, clock=clock)
    assert not keys.enabled
    assert keys.check(None)
    assert keys.check("Bearer whatever")
    assert keys.check("garbage")


def test_valid_and_invalid_tokens(key_file: Path, clock: FakeClock) -> None:
    keys = ApiKeys(key_file, clock=clock)
    assert keys.enabled
    assert keys.key_count == 2
    assert keys.check(f"Bearer {KEY_A}")
    assert keys.check(f"Bearer {KEY_B}")
    assert not keys.check("Bearer sk-not-a-key")
    assert not keys.check(f"Bearer {KEY_A}x")
    assert not keys.check(f"Bearer {KEY_A[:-1]}")


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        KEY_A,  # no scheme
        f"Basic {KEY_A}",
        f"Token {KEY_A}",
        f"Bearer{KEY_A}",  # no space
        f"Bearer:{KEY_A}",
        "Bearer",
        "Bearer ",
        "Bearer    ",
        f"Bearer {KEY_A} extra",
        f"Bearer {KEY_A} {KEY_B}",
        f"Bearer\t{KEY_A}",
        f"Bearer {KEY_A}\n{KEY_B}",
    ],
)
def test_malformed_headers_refused(key_file: Path, clock: FakeClock, header: str | None) -> None:
    assert not ApiKeys(key_file, clock=clock).check(header)


@pytest.mark.parametrize("header", [f"bearer {KEY_A}", f"BEARER {KEY_A}", f"BeArEr   {KEY_A}", f"Bearer {KEY_A} "])
def test_scheme_case_and_spacing(key_file: Path, clock: FakeClock, header: str) -> None:
    assert ApiKeys(key_file, clock=clock).check(header)


def test_comments_blank_lines_and_whitespace(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "keys"
    write_keys(
        path,
        f"# team keys\n\n   \n  {KEY_A}  \n\t{KEY_B}\r\n  # {KEY_C}\n#{KEY_C}\n{KEY_A}\nbad key,\n",
    )
    keys = ApiKeys(path, clock=clock)
    assert keys.key_count == 2  # duplicate collapsed, comments and the line with a bad scope skipped
    assert keys.check(f"Bearer {KEY_A}")
    assert keys.check(f"Bearer {KEY_B}")
    assert not keys.check(f"Bearer {KEY_C}")
    assert not keys.check(f"Bearer #{KEY_C}")
    assert not keys.check("Bearer bad")
    assert not keys.check("Bearer key")


def test_unicode_keys(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "keys"
    write_keys(path, "clé-ünïcødé-κλειδί\n")
    assert ApiKeys(path, clock=clock).check("Bearer clé-ünïcødé-κλειδί")


def test_empty_file_refuses_everyone_and_warns(
    tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys"
    write_keys(path, "# nobody yet\n\n")
    with caplog.at_level(logging.INFO, logger="wakegate.extproc.auth"):
        keys = ApiKeys(path, clock=clock)
        for _ in range(5):
            clock.advance(2)
            assert not keys.check("Bearer anything")
    assert keys.enabled
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "0 keys" in warnings[0].getMessage()


def test_missing_file_at_startup(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "nope" / "keys.txt"
    with pytest.raises(AuthConfigError, match=r"nope/keys\.txt") as info:
        ApiKeys(path, clock=clock)
    assert isinstance(info.value, ValueError)


def test_directory_at_startup(tmp_path: Path, clock: FakeClock) -> None:
    with pytest.raises(AuthConfigError, match=re.escape(str(tmp_path))):
        ApiKeys(tmp_path, clock=clock)


def test_non_utf8_at_startup_does_not_leak_contents(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "keys"
    path.write_bytes(b"sk-secret-prefix\xff\xfe-tail\n")
    with pytest.raises(AuthConfigError) as info:
        ApiKeys(path, clock=clock)
    message = str(info.value)
    assert str(path) in message
    assert "secret" not in message
    assert info.value.__cause__ is None
    assert info.value.__suppress_context__


def test_rotation(key_file: Path, clock: FakeClock) -> None:
    keys = ApiKeys(key_file, reload_interval=1.0, clock=clock)
    assert keys.check(f"Bearer {KEY_A}")
    write_keys(key_file, f"{KEY_C}\n{KEY_B}\n")
    # Within the interval the old keys still hold.
    clock.advance(0.5)
    assert keys.check(f"Bearer {KEY_A}")
    assert not keys.check(f"Bearer {KEY_C}")
    clock.advance(0.6)
    assert not keys.check(f"Bearer {KEY_A}")
    assert keys.check(f"Bearer {KEY_C}")
    assert keys.check(f"Bearer {KEY_B}")


def test_rotation_by_atomic_rename(key_file: Path, clock: FakeClock) -> None:
    keys = ApiKeys(key_file, clock=clock)
    tmp = key_file.with_name("keys.tmp")
    write_keys(tmp, f"{KEY_C}\n")
    os.replace(tmp, key_file)
    clock.advance(1.0)
    assert keys.check(f"Bearer {KEY_C}")
    assert not keys.check(f"Bearer {KEY_A}")


def test_same_size_and_mtime_change_detected_by_inode(key_file: Path, clock: FakeClock) -> None:
    keys = ApiKeys(key_file, clock=clock)
    st = key_file.stat()
    new = key_file.with_name("new")
    # Same length as the original content, same mtime: only the inode differs.
    new.write_text(f"{KEY_A[::-1]}\n{KEY_B}\n", encoding="utf-8")
    os.utime(new, ns=(st.st_mtime_ns, st.st_mtime_ns))
    assert new.stat().st_size == st.st_size
    os.replace(new, key_file)
    clock.advance(1.0)
    assert keys.check(f"Bearer {KEY_A[::-1]}")
    assert not keys.check(f"Bearer {KEY_A}")


def test_no_restat_before_interval(key_file: Path, clock: FakeClock, stat_calls: list[Path]) -> None:
    keys = ApiKeys(key_file, reload_interval=1.0, clock=clock)
    for _ in range(100):
        keys.check(f"Bearer {KEY_A}")
        clock.advance(0.001)
    assert stat_calls == []
    clock.advance(1.0)
    for _ in range(100):
        keys.check(f"Bearer {KEY_A}")
    assert len(stat_calls) == 1
    clock.advance(0.999)
    keys.check(f"Bearer {KEY_A}")
    assert len(stat_calls) == 1
    clock.advance(0.001)
    keys.check(f"Bearer {KEY_A}")
    assert len(stat_calls) == 2


def test_disabled_never_stats(clock: FakeClock, stat_calls: list[Path]) -> None:
    keys = ApiKeys(None, clock=clock)
    for _ in range(10):
        clock.advance(5)
        keys.check("Bearer x")
    keys.reload_if_changed()
    assert stat_calls == []


def test_unchanged_file_is_not_reread(key_file: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = ApiKeys(key_file, clock=clock)
    reads: list[Path] = []
    real = keyfile._read

    def counting(path: Path) -> tuple[tuple[int, int, int], str]:
        reads.append(path)
        return real(path)

    monkeypatch.setattr(keyfile, "_read", counting)
    for _ in range(5):
        clock.advance(1.0)
        assert keys.check(f"Bearer {KEY_A}")
    assert reads == []
    write_keys(key_file, f"{KEY_C}\n")
    clock.advance(1.0)
    assert keys.check(f"Bearer {KEY_C}")
    assert len(reads) == 1


def test_vanished_file_keeps_old_keys(key_file: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    keys = ApiKeys(key_file, clock=clock)
    key_file.unlink()
    with caplog.at_level(logging.INFO, logger="wakegate.extproc.auth"):
        for _ in range(5):
            clock.advance(1.5)
            assert keys.check(f"Bearer {KEY_A}")
            assert not keys.check(f"Bearer {KEY_C}")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # once per change, not once per interval
    assert str(key_file) in warnings[0].getMessage()
    # It comes back with new content: picked up, and a later disappearance warns again.
    write_keys(key_file, f"{KEY_C}\n")
    clock.advance(1.0)
    assert keys.check(f"Bearer {KEY_C}")
    assert not keys.check(f"Bearer {KEY_A}")
    key_file.unlink()
    with caplog.at_level(logging.INFO, logger="wakegate.extproc.auth"):
        clock.advance(1.0)
        assert keys.check(f"Bearer {KEY_C}")
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


def test_unreadable_later_keeps_old_keys_and_recovers(
    key_file: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = ApiKeys(key_file, clock=clock)
    real = keyfile._read

    def denied(path: Path) -> tuple[tuple[int, int, int], str]:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(keyfile, "_read", denied)
    write_keys(key_file, f"{KEY_C}\n")
    clock.advance(1.0)
    assert keys.check(f"Bearer {KEY_A}")
    assert not keys.check(f"Bearer {KEY_C}")
    # Permission fixed without touching the file (fingerprint unchanged): retried and loaded.
    monkeypatch.setattr(keyfile, "_read", real)
    clock.advance(1.0)
    assert keys.check(f"Bearer {KEY_C}")
    assert not keys.check(f"Bearer {KEY_A}")


def test_invalid_utf8_later_keeps_old_keys(key_file: Path, clock: FakeClock) -> None:
    keys = ApiKeys(key_file, clock=clock)
    key_file.write_bytes(f"{KEY_C}\xff\n".encode("latin-1"))
    clock.advance(1.0)
    assert keys.check(f"Bearer {KEY_A}")
    assert not keys.check(f"Bearer {KEY_C}")


def test_reload_if_changed_always_stats(key_file: Path, clock: FakeClock, stat_calls: list[Path]) -> None:
    keys = ApiKeys(key_file, clock=clock)
    write_keys(key_file, f"{KEY_C}\n")
    keys.reload_if_changed()  # no clock advance needed
    assert len(stat_calls) == 1
    assert keys.check(f"Bearer {KEY_C}")


def test_compares_against_every_digest(key_file: Path, clock: FakeClock, digest_compares: list[int]) -> None:
    path = key_file
    write_keys(path, "".join(f"sk-key-{i:04d}\n" for i in range(50)))
    keys = ApiKeys(path, clock=clock)
    calls = digest_compares
    for token in ("sk-key-0000", "sk-key-0025", "sk-key-0049", "sk-nope"):
        calls.clear()
        keys.check(f"Bearer {token}")
        assert len(calls) == 50, token  # no early exit, whether or where it matched
    assert keys.check("Bearer sk-key-0000")
    assert not keys.check("Bearer sk-nope")


def test_only_digests_are_stored(key_file: Path, clock: FakeClock) -> None:
    keys = ApiKeys(key_file, clock=clock)
    state = repr(vars(keys))
    assert KEY_A not in state
    assert KEY_B not in state


def test_logs_never_contain_keys_or_tokens(
    tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "keys"
    secrets = [KEY_A, KEY_B, KEY_C, "sk-bad-scope", "sk-token-never-valid"]
    with caplog.at_level(logging.DEBUG):
        write_keys(path, f"{KEY_A}\nsk-bad-scope chat,,other\n")
        keys = ApiKeys(path, clock=clock)
        keys.check(f"Bearer {KEY_A}")
        keys.check("Bearer sk-token-never-valid")
        keys.check("Basic sk-token-never-valid")
        write_keys(path, f"{KEY_B}\n{KEY_C}\n")
        clock.advance(1)
        keys.check("Bearer sk-token-never-valid")
        write_keys(path, "")  # empty file
        clock.advance(1)
        keys.check(f"Bearer {KEY_B}")
        path.write_bytes(f"{KEY_C}\xff".encode("latin-1"))  # undecodable
        clock.advance(1)
        keys.check(f"Bearer {KEY_C}")
        path.unlink()  # vanished
        clock.advance(1)
        keys.check(f"Bearer {KEY_C}")
        with pytest.raises(AuthConfigError) as info:
            ApiKeys(path, clock=clock)
    assert "reloaded" in caplog.text
    assert len(caplog.records) >= 5
    logged = caplog.text + str(info.value) + "".join(str(r.args) for r in caplog.records)
    for secret in secrets:
        assert secret not in logged


def test_negative_interval_rejected(key_file: Path) -> None:
    with pytest.raises(ValueError):
        ApiKeys(key_file, reload_interval=-1)


# -- scoped keys -----------------------------------------------------------------------------------


def test_parse_plain_and_scoped_lines() -> None:
    entries, bad = auth.parse_keys(
        f"{KEY_A}\n{KEY_B}  chat-a, ns/chat-b\n{KEY_C}\t*\nsk-d chat-a,chat-c\nsk-d chat-b\n"
    )
    scopes = {digest: scope for digest, scope in entries}
    assert bad == []
    assert scopes[auth._digest(KEY_A)] is auth.ALL_MODELS
    assert scopes[auth._digest(KEY_B)] == auth.Scope(frozenset({"chat-a", "ns/chat-b"}))
    assert scopes[auth._digest(KEY_C)] is auth.ALL_MODELS  # `*`: every model
    assert scopes[auth._digest("sk-d")] == auth.Scope(frozenset({"chat-a", "chat-b", "chat-c"}))  # lines add up


def test_a_plain_line_widens_a_scoped_key_to_every_model() -> None:
    entries, _ = auth.parse_keys(f"{KEY_A} chat-a\n{KEY_A}\n")
    assert entries == ((auth._digest(KEY_A), auth.ALL_MODELS),)


@pytest.mark.parametrize("line", ["k a,,b", "k a,", "k ,a", "k a b", "k a, b c", "k ,"])
def test_bad_scopes_are_reported_by_line_number(line: str) -> None:
    entries, bad = auth.parse_keys(f"# header\n{KEY_A}\n\n{line}\n{KEY_B} ok\n")
    assert bad == [4]
    assert [digest for digest, _ in entries] == [auth._digest(KEY_A), auth._digest(KEY_B)]


def test_bad_line_warning_names_the_line_not_the_key(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "keys"
    write_keys(path, f"{KEY_A}\n{KEY_B} chat,,x\n")
    with caplog.at_level(logging.INFO, logger="wakegate.extproc.auth"):
        keys = ApiKeys(path)
    assert not keys.check(f"Bearer {KEY_B}")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "line 2" in warnings[0], warnings
    assert KEY_B not in caplog.text and "chat,,x" not in caplog.text


def test_scope_of_a_token(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "keys"
    write_keys(path, f"{KEY_A}\n{KEY_B} chat-a,team/chat-b\n")
    keys = ApiKeys(path, clock=clock)
    assert keys.scope(f"Bearer {KEY_A}") is auth.ALL_MODELS
    scoped = keys.scope(f"Bearer {KEY_B}")
    assert scoped is not None
    assert scoped.allows("chat-a", "chat-a")
    assert scoped.allows("team/chat-b", "chat-b")  # by the model's key
    assert not scoped.allows("other/chat-b", "chat-b-2")
    assert not scoped.allows("chat-c", "chat-c")
    assert keys.scope("Bearer sk-nope") is None
    assert keys.scope(None) is None
    assert ApiKeys(None).scope(None) is auth.ALL_MODELS


def test_scoped_key_by_own_name_on_kubernetes() -> None:
    scope = auth.Scope(frozenset({"chat-b"}))
    assert scope.allows("team/chat-b", "chat-b")  # a Model's own name matches in any namespace
    assert not scope.allows("team/chat-a", "chat-a")


def test_scoped_rotation(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "keys"
    write_keys(path, f"{KEY_A} chat-a\n")
    keys = ApiKeys(path, clock=clock)
    before = keys.scope(f"Bearer {KEY_A}")
    assert before is not None and not before.allows("chat-b", "chat-b")
    write_keys(path, f"{KEY_A} chat-a,chat-b\n")
    clock.advance(1)
    after = keys.scope(f"Bearer {KEY_A}")
    assert after is not None and after.allows("chat-b", "chat-b")


def test_scoped_keys_still_compare_every_digest(tmp_path: Path, clock: FakeClock, digest_compares: list[int]) -> None:
    path = tmp_path / "keys"
    write_keys(path, "".join(f"sk-key-{i:04d} model-{i % 3}\n" for i in range(30)))
    keys = ApiKeys(path, clock=clock)
    calls = digest_compares
    for token in ("sk-key-0000", "sk-key-0029", "sk-nope"):
        calls.clear()
        keys.scope(f"Bearer {token}")
        assert len(calls) == 30, token
    found = keys.scope("Bearer sk-key-0004")
    assert found == auth.Scope(frozenset({"model-1"}))
