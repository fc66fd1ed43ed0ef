"""A real OCI registry for tests: the CNCF Distribution registry on a loopback port.

    with start_registry(tmp_path, auth=True, tls=True) as reg:
        reg.oras("push", f"{reg.host}/models/tiny:v1", "model.gguf:application/x-gguf")
        status, headers, body = reg.request("GET", "/v2/_catalog")

Storage is a directory under `workdir` (filesystem driver, deletes enabled). `auth=True`
turns on htpasswd basic auth with a generated user and password (bcrypt, as the registry
wants); `reg.docker_config` is then a Docker config.json holding them, the form clients
read credentials from. `tls=True` serves HTTPS with a certificate from a throwaway CA
(`reg.ca`). `token_auth=True` turns on the registry's `token` auth instead: the Bearer flow,
with tokens from a token service on loopback (`e2e/tools/tokenauth.py`, `reg.tokens`) that grants
the same generated user every action and anybody else none. The registry picks its own port
(it listens on 127.0.0.1:0 and logs the address), so two registries never race for one.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import ssl
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from email.message import Message
from pathlib import Path
from typing import Any

import bcrypt
import yaml

from e2e import tools
from e2e.pki import PKI
from e2e.procs import Proc
from e2e.tools.tokenauth import ISSUER, SERVICE, TokenService, start_token_service

#: how long the registry may take to log its address and answer /v2/
START_TIMEOUT = 30.0


class RegistryError(RuntimeError):
    pass


@dataclass(frozen=True)
class Credentials:
    user: str
    password: str

    def basic(self) -> str:
        """The value of an Authorization header carrying these credentials."""
        return "Basic " + base64.b64encode(f"{self.user}:{self.password}".encode()).decode()


@dataclass(frozen=True)
class Response:
    status: int
    headers: Message
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True)
class Registry:
    """A running registry and how to reach it."""

    #: HOST:PORT, the form image references and `oras` take
    host: str
    #: http(s)://HOST:PORT
    url: str
    storage: Path
    log: Path
    #: the CA that signed the serving certificate (tls=True), else None
    ca: Path | None
    #: the user tests log in as (auth=True), else None
    credentials: Credentials | None
    #: a Docker config.json with `credentials` for `host` (no entries without auth)
    docker_config: Path
    #: a Docker config.json with no entries, so a client cannot find this user's own
    anonymous_config: Path
    pid: int
    #: the token service (token_auth=True), else None
    tokens: TokenService | None = None

    def ssl_context(self) -> ssl.SSLContext | None:
        return ssl.create_default_context(cafile=str(self.ca)) if self.ca else None

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        anonymous: bool = False,
        timeout: float = 10.0,
    ) -> Response:
        """One HTTP request to `path` (e.g. "/v2/_catalog"), as the test user unless `anonymous`.

        Error statuses are returned, not raised: tests assert on them."""
        headers = dict(headers or {})
        if self.credentials and not anonymous:
            headers["Authorization"] = (
                self._bearer(method, path) if self.tokens else self.credentials.basic()
            )
        req = urllib.request.Request(self.url + path, data=body, headers=headers, method=method)
        return self._open(req, timeout)

    def upload_blob(self, repo: str, digest: str, body: bytes, mount_from: str | None = None) -> None:
        """Put a blob into `repo` (one POST, one PUT), or mount it from `mount_from` that holds it."""
        if mount_from is not None:
            mounted = self.request("POST", f"/v2/{repo}/blobs/uploads/?mount={digest}&from={mount_from}")
            assert mounted.status == 201, mounted.body
            return
        started = self.request("POST", f"/v2/{repo}/blobs/uploads/")
        assert started.status == 202, started.body
        location = urllib.parse.urlsplit(started.headers["Location"])
        query = f"{location.query}&" if location.query else ""
        done = self.request("PUT", f"{location.path}?{query}digest={digest}", body=body,
                            headers={"Content-Type": "application/octet-stream"})
        assert done.status == 201, done.body

    def _open(self, req: urllib.request.Request, timeout: float) -> Response:
        # No proxy from the environment: test traffic stays on loopback.
        opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=self.ssl_context())
        )
        try:
            with opener.open(req, timeout=timeout) as resp:
                return Response(resp.status, resp.headers, resp.read())
        except urllib.error.HTTPError as exc:
            with exc:
                return Response(exc.code, exc.headers, exc.read())

    def _bearer(self, method: str, path: str) -> str:
        """A token for what `path` touches, from the token service, as the test user."""
        assert self.tokens is not None and self.credentials is not None
        name = re.match(r"^/v2/(.+?)/(?:manifests|blobs|tags)/", path)
        scope = ""
        if name:
            scope = f"repository:{name.group(1)}:{'pull' if method in ('GET', 'HEAD') else 'pull,push'}"
        elif path.startswith("/v2/_catalog"):
            scope = "registry:catalog:*"
        params = {"service": SERVICE, **({"scope": scope} if scope else {})}
        query = "?" + urllib.parse.urlencode(params)
        req = urllib.request.Request(self.tokens.url + query, headers={"Authorization": self.credentials.basic()})
        token = self._open(req, 10.0).json()["token"]
        return f"Bearer {token}"

    def requests(self) -> list[str]:
        """`METHOD PATH` of every request served so far (needs `access_log=True`)."""
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            match = re.search(r'"(GET|HEAD|PUT|POST|PATCH|DELETE) (\S+) HTTP/', line)
            if match:
                out.append(f"{match.group(1)} {match.group(2)}")
        return out

    def oras_flags(self, anonymous: bool = False) -> list[str]:
        """`oras` flags for this registry: transport, CA, and credentials unless `anonymous`."""
        flags = ["--ca-file", str(self.ca)] if self.ca else ["--plain-http"]
        return [*flags, "--registry-config", str(self.anonymous_config if anonymous else self.docker_config)]

    def oras(self, *args: str, anonymous: bool = False, cwd: Path | None = None, timeout: float = 120.0,
             ) -> subprocess.CompletedProcess[str]:
        """`oras ARGS...` against this registry (oras is built on first use); its exit code is not checked.

        Run it in `cwd` when pushing: oras takes file paths relative to where it runs."""
        argv = [str(tools.ensure("oras")), *args, *self.oras_flags(anonymous)]
        return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=timeout)


def htpasswd_line(credentials: Credentials) -> str:
    """One htpasswd entry; the registry accepts bcrypt hashes only."""
    hashed = bcrypt.hashpw(credentials.password.encode(), bcrypt.gensalt(rounds=10)).decode()
    return f"{credentials.user}:{hashed}\n"


def _config(workdir: Path, storage: Path, htpasswd: Path | None, tls: tuple[Path, Path] | None,
            tokens: TokenService | None = None, access_log: bool = False) -> Path:
    http: dict[str, object] = {
        "addr": "127.0.0.1:0",
        "secret": secrets.token_hex(16),
        # SIGTERM then drains requests and exits 0 instead of dying on the signal.
        "draintimeout": "5s",
    }
    if tls:
        http["tls"] = {"certificate": str(tls[0]), "key": str(tls[1])}
    config: dict[str, object] = {
        "version": 0.1,
        # JSON lines: the address the registry picked is read from its log.
        "log": {"level": "info", "formatter": "json", "accesslog": {"disabled": not access_log}},
        "storage": {
            "filesystem": {"rootdirectory": str(storage)},
            "delete": {"enabled": True},
            "maintenance": {"uploadpurging": {"enabled": False}},
        },
        "http": http,
    }
    if htpasswd:
        config["auth"] = {"htpasswd": {"realm": "wakegate-tests", "path": str(htpasswd)}}
    if tokens:
        config["auth"] = {"token": {"realm": tokens.url, "service": SERVICE, "issuer": ISSUER,
                                    "rootcertbundle": str(tokens.ca)}}
    return _write_private(workdir / "config.yaml", yaml.safe_dump(config, sort_keys=False))


def _write_private(path: Path, text: str) -> Path:
    """A file only its owner can read (it may hold a secret), created that way."""
    path.unlink(missing_ok=True)
    path.touch(mode=0o600)
    path.write_text(text)
    return path


def _listening_address(log: Path) -> str | None:
    """HOST:PORT from the registry's "listening on ..." log line, once it is there."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return None
    for line in lines:
        try:
            msg = json.loads(line).get("msg", "")
        except (ValueError, AttributeError):
            continue
        if isinstance(msg, str) and msg.startswith("listening on "):
            return msg.removeprefix("listening on ").split(",")[0].strip()
    return None


@contextmanager
def start_registry(workdir: Path, auth: bool = False, tls: bool = False,
                   token_auth: bool = False, access_log: bool = False) -> Iterator[Registry]:
    """Start a registry keeping its files under `workdir`; it answers /v2/ when this yields,
    and is stopped (SIGTERM, then SIGKILL after 5 s) when the block ends. With `access_log`,
    every request is a line in `reg.log` (`Registry.requests()` lists them)."""
    workdir.mkdir(parents=True, exist_ok=True)
    credentials = Credentials("wakegate", secrets.token_urlsafe(16)) if auth or token_auth else None
    if token_auth:
        assert credentials is not None
        with (start_token_service(workdir, credentials.user, credentials.password) as tokens,
              _start_registry(workdir, credentials, tls, tokens, access_log) as registry):
            yield registry
        return
    with _start_registry(workdir, credentials, tls, None, access_log) as registry:
        yield registry


@contextmanager
def _start_registry(workdir: Path, credentials: Credentials | None, tls: bool,
                    tokens: TokenService | None, access_log: bool) -> Iterator[Registry]:
    storage = workdir / "storage"
    storage.mkdir(exist_ok=True)
    htpasswd = None
    if credentials and tokens is None:
        htpasswd = _write_private(workdir / "htpasswd", htpasswd_line(credentials))
    ca = pair = None
    if tls:
        pki = PKI(workdir / "pki")
        ca, pair = pki.ca.cert, pki.issue("registry", "127.0.0.1", server=True)
    config = _config(workdir, storage, htpasswd, (pair.cert, pair.key) if pair else None, tokens,
                     access_log)
    proc = Proc("registry", [str(tools.ensure("registry")), "serve", str(config)], workdir / "registry.log")
    proc.start()
    try:
        host = _wait_for_address(proc)
        auths = {host: {"auth": credentials.basic().removeprefix("Basic ")}} if credentials else {}
        docker_config = _write_private(workdir / "docker-config.json", json.dumps({"auths": auths}))
        anonymous_config = _write_private(workdir / "anonymous-config.json", json.dumps({"auths": {}}))
        scheme = "https" if tls else "http"
        registry = Registry(host, f"{scheme}://{host}", storage, proc.log, ca, credentials, docker_config,
                            anonymous_config, proc.pid, tokens)
        _wait_until_serving(registry, proc)
        yield registry
    finally:
        proc.stop()


def _wait_for_address(proc: Proc) -> str:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        address = _listening_address(proc.log)
        if address:
            return address
        if proc.exited() is not None:
            raise RegistryError(f"registry exited with {proc.exited()}:\n{proc.tail()}")
        time.sleep(0.05)
    raise RegistryError(f"registry logged no address within {START_TIMEOUT:.0f}s:\n{proc.tail()}")


def _wait_until_serving(registry: Registry, proc: Proc) -> None:
    """Until /v2/ answers 200 (with auth, to the test user: the credentials work too)."""
    deadline = time.monotonic() + START_TIMEOUT
    last: object = None
    while True:
        try:
            status = registry.request("GET", "/v2/", timeout=2).status
            if status == 200:
                return
            last = f"HTTP {status}"
        except OSError as exc:
            last = exc
        if proc.exited() is not None:
            raise RegistryError(f"registry exited with {proc.exited()}:\n{proc.tail()}")
        if time.monotonic() > deadline:
            raise RegistryError(f"registry at {registry.url} did not answer /v2/ ({last}):\n{proc.tail()}")
        time.sleep(0.05)
