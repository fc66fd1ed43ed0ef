"""The internal token: where processes find it, how servers check it, what they say when they refuse."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from wakegate import internal_token
from wakegate.internal_token import ENV, HEADER, Authenticator, TokenSource, generate, presented


class Context:
    """What a server sees of a call: its metadata and its peer."""

    def __init__(self, *metadata: tuple[str, str]) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> Any:
        return self.metadata

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5555"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_generated_token_is_random_owner_only_and_kept(tmp_path: Path) -> None:
    path = generate(tmp_path / "state" / "secrets" / "token")
    token = path.read_text().strip()
    assert len(token) >= 40
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    assert generate(path).read_text().strip() == token, "an existing token is kept (children read it)"
    assert generate(tmp_path / "other" / "token").read_text().strip() != token


def test_file_is_reread_when_it_changes_and_a_lost_file_keeps_the_last_token(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("first\n")
    clock = Clock()
    source = TokenSource(path, clock=clock)
    assert source.value() == "first"
    path.write_text("second-and-longer\n")
    assert source.value() == "first", "stat'ed at most once a second"
    clock.now += 1.5
    assert source.value() == "second-and-longer"
    path.unlink()
    clock.now += 1.5
    assert source.value() == "second-and-longer"
    assert source.metadata() == (("authorization", "Bearer second-and-longer"),)


def test_environment_when_no_file_and_empty_is_none() -> None:
    assert TokenSource(None, environ={ENV: " from-env \n"}).value() == "from-env"
    assert TokenSource(None, environ={ENV: "  "}).value() is None
    assert TokenSource(None, environ={}).metadata() == ()
    assert TokenSource(None, environ={}).describe() == f"${ENV}"


def test_presented_reads_bearer_or_envoys_header() -> None:
    assert presented([("authorization", "Bearer abc")]) == "abc"
    assert presented([("authorization", "bearer  abc ")]) == "abc"
    assert presented([(HEADER, "xyz")]) == "xyz"
    assert presented([("authorization", "Basic abc")]) == ""
    assert presented(None) == ""


def test_authenticator_allows_the_token_and_counts_what_it_refuses(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    auth = Authenticator(TokenSource(None, environ={ENV: "s3cret"}), clock=clock)
    assert auth.allows(Context(("authorization", "Bearer s3cret")), "ads")
    assert auth.allows(Context((HEADER, "s3cret")), "ads")
    assert auth.refused == {}
    with caplog.at_level(logging.WARNING, "wakegate.auth"):
        for _ in range(5):
            assert not auth.allows(Context(), "ads")
        assert not auth.allows(Context(("authorization", "Bearer s3cre")), "demand")
        assert not auth.allows(Context((HEADER, "s3cret-and-more")), "demand")
        assert auth.refused == {"ads": 5, "demand": 2}
        assert len(caplog.records) == 1, "one line per interval"
        clock.now += internal_token.LOG_INTERVAL
        assert not auth.allows(Context(("authorization", "Bearer nope")), "demand")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0] == "refused unauthenticated ads call from ipv4:127.0.0.1:5555: no token"
    assert "demand call" in lines[1] and "(7 refused since the last line)" in lines[1]
    assert not any("s3cre" in line or "nope" in line for line in lines), "never a token in a log line"


def test_a_server_without_a_token_refuses_everyone() -> None:
    auth = Authenticator(TokenSource(None, environ={}))
    assert not auth.allows(Context(("authorization", "Bearer ")), "ads")
    assert not auth.allows(Context(), "ads")
    assert auth.refused == {"ads": 2}


def _args(server: bool, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    internal_token.add_arguments(parser, server=server)
    return parser.parse_args(argv)


def test_servers_need_a_token_unless_told_otherwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(ValueError, match="no internal token"):
        internal_token.source_from(_args(True), server=True)
    assert internal_token.source_from(_args(True, "--no-internal-auth"), server=True) is None
    path = tmp_path / "t"
    path.write_text("x\n")
    source = internal_token.source_from(_args(True, "--internal-token-file", str(path)), server=True)
    assert source is not None and source.value() == "x"
    monkeypatch.setenv(ENV, "y")
    source = internal_token.source_from(_args(True), server=True)
    assert source is not None and source.value() == "y"
    client = internal_token.source_from(_args(False), server=False)
    assert client is not None and client.file is None


def test_the_feeder_will_not_start_without_a_token() -> None:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    out = subprocess.run(
        [sys.executable, "-m", "wakegate", "xds", "--listen", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 2
    assert "no internal token" in out.stderr and "Traceback" not in out.stderr
