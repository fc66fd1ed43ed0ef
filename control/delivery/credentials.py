"""Registry credentials from a Docker config file, and the registry's authentication challenges.

Pure: text in, values out (the registry client reads the file). A Docker config (`config.json`,
or a Kubernetes `kubernetes.io/dockerconfigjson` Secret's `.dockerconfigjson`, the same format)
holds `auths`: per registry host, either `auth` (base64 of `user:password`) or `username` and
`password`. Credential helpers (`credsStore`, `credHelpers`) run other programs and are not
supported; neither are `identitytoken` (OAuth refresh) entries. Either is named in a warning,
and that registry is then spoken to anonymously.

A password never appears in a repr, a log line or an exception message: `Credentials` hides it,
and nothing here formats it.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = field(repr=False)

    def basic(self) -> str:
        """The Authorization header value for HTTP Basic."""
        return "Basic " + base64.b64encode(f"{self.username}:{self.password}".encode()).decode()


@dataclass(frozen=True)
class DockerAuths:
    """What a Docker config offers: credentials per registry host, and what could not be used."""

    by_host: Mapping[str, Credentials] = field(default_factory=dict)
    unsupported: tuple[str, ...] = ()
    """One line per thing ignored (credential helpers, identity tokens), for a warning."""

    def for_host(self, host: str) -> Credentials | None:
        return self.by_host.get(normalise_host(host))


_DOCKER_HUB = ("docker.io", "index.docker.io", "registry-1.docker.io")


def normalise_host(key: str) -> str:
    """The registry host an `auths` key names: scheme and path dropped, Docker Hub's names merged."""
    host = re.sub(r"^[a-z]+://", "", key.strip()).split("/", 1)[0].lower()
    return "docker.io" if host in _DOCKER_HUB else host


def parse_docker_config(text: str, where: str = "docker config") -> DockerAuths:
    """The credentials in a Docker config's text; a file that is not one is a ValueError naming
    `where` (never its content)."""
    try:
        doc = json.loads(text)
    except ValueError:
        raise ValueError(f"{where} is not JSON") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{where} is not a JSON object")
    unsupported: list[str] = []
    if doc.get("credsStore"):
        unsupported.append(f"{where}: credsStore {doc['credsStore']!r} is not supported (credential helpers)")
    if doc.get("credHelpers"):
        unsupported.append(f"{where}: credHelpers are not supported (credential helpers)")
    auths = doc.get("auths") or {}
    if not isinstance(auths, dict):
        raise ValueError(f"{where}: auths is not an object")
    by_host: dict[str, Credentials] = {}
    for key, entry in auths.items():
        if not isinstance(entry, dict):
            continue
        host = normalise_host(str(key))
        creds = _entry_credentials(entry)
        if creds is not None:
            by_host[host] = creds
        elif entry.get("identitytoken"):
            unsupported.append(f"{where}: the identitytoken for {host} is not supported")
        elif entry:
            unsupported.append(f"{where}: the entry for {host} has no usable auth")
    return DockerAuths(by_host, tuple(unsupported))


def _entry_credentials(entry: Mapping[str, object]) -> Credentials | None:
    auth = entry.get("auth")
    if isinstance(auth, str) and auth:
        try:
            decoded: str = base64.b64decode(auth, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None
        user, sep, password = decoded.partition(":")
        return Credentials(user, password) if sep else None
    name, secret = entry.get("username"), entry.get("password")
    if isinstance(name, str) and isinstance(secret, str) and name:
        return Credentials(name, secret)
    return None


@dataclass(frozen=True)
class Challenge:
    scheme: str
    """`basic` or `bearer` (lower case)."""
    params: Mapping[str, str]


_PARAM = re.compile(r'\s*([A-Za-z0-9_.-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^,\s]*)\s*,?')


def parse_challenge(header: str) -> Challenge:
    """A `WWW-Authenticate` header: `Bearer realm="…",service="…",scope="repository:x:pull,push"`.
    Quoted values may contain commas."""
    scheme, _, rest = header.strip().partition(" ")
    params: dict[str, str] = {}
    pos = 0
    while pos < len(rest):
        match = _PARAM.match(rest, pos)
        if not match or match.end() == pos:
            break
        name, value = match.group(1).lower(), match.group(2)
        if value.startswith('"'):
            value = re.sub(r"\\(.)", r"\1", value[1:-1])
        params[name] = value
        pos = match.end()
    return Challenge(scheme.lower(), params)
