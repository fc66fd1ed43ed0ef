"""Docker config credentials and registry challenges, and that a password never shows."""

from __future__ import annotations

import base64
import json

import pytest

from wakegate.control.delivery.credentials import Credentials, normalise_host, parse_challenge, parse_docker_config


def test_auths_entries_in_every_spelling_give_credentials() -> None:
    config = {
        "auths": {
            "https://reg.example.com:5000/v1/": {"auth": base64.b64encode(b"alice:s3cr:et").decode()},
            "ghcr.io": {"username": "bob", "password": "pw"},
            "https://index.docker.io/v1/": {"auth": base64.b64encode(b"carol:x").decode()},
            "quay.io": {"identitytoken": "refresh"},
        },
        "credsStore": "desktop",
    }
    auths = parse_docker_config(json.dumps(config))
    assert auths.for_host("reg.example.com:5000") == Credentials("alice", "s3cr:et")
    assert auths.for_host("GHCR.IO") == Credentials("bob", "pw")
    assert auths.for_host("registry-1.docker.io") == Credentials("carol", "x")
    assert auths.for_host("quay.io") is None
    assert any("credsStore" in line for line in auths.unsupported)
    assert any("identitytoken" in line for line in auths.unsupported)


def test_a_file_that_is_not_a_config_is_refused_without_its_content() -> None:
    with pytest.raises(ValueError) as err:
        parse_docker_config('{"auths": "hunter2"', "/run/secrets/config.json")
    assert "hunter2" not in str(err.value) and "/run/secrets/config.json" in str(err.value)


def test_the_password_is_in_no_repr() -> None:
    creds = Credentials("alice", "hunter2")
    assert "hunter2" not in repr(creds) and "hunter2" not in str(creds)
    assert "hunter2" not in repr(
        parse_docker_config(json.dumps({"auths": {"r.io": {"username": "a", "password": "hunter2"}}}))
    )


def test_challenges_keep_quoted_commas() -> None:
    challenge = parse_challenge(
        'Bearer realm="https://auth.example/token",service="registry.example",'
        'scope="repository:models/tiny:pull,push",error="insufficient_scope"'
    )
    assert challenge.scheme == "bearer"
    assert challenge.params == {
        "realm": "https://auth.example/token",
        "service": "registry.example",
        "scope": "repository:models/tiny:pull,push",
        "error": "insufficient_scope",
    }
    assert parse_challenge('Basic realm="wakegate-tests"').scheme == "basic"
    assert normalise_host("http://Reg.Example:80/path") == "reg.example:80"
