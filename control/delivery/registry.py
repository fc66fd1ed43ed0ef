"""An OCI distribution client on aiohttp: manifests, blobs streamed to disk and verified, and push.

What it does, and why it is ours rather than a library's (docs/decisions.md, "Model delivery"):
- blobs are written while they arrive and hashed on a worker thread (the whole-file digest and
  the block table, `digests.Digester`), so the event loop stays free and a second core hashes;
  a broken transfer resumes with `Range` from what is on disk (re-hashed first), up to
  `retries` times;
- authentication answers the registry's `WWW-Authenticate` challenge: Basic with the host's
  credentials, or the Bearer token flow (a token per repository scope from the realm the
  registry names, fetched with those credentials or anonymously); a realm over plain HTTP gets
  no credentials unless it is on loopback;
- redirects (blob storage elsewhere) are followed by hand, and the Authorization header only
  goes to the registry's own origin;
- HTTPS with the system's CAs plus `ca_file`; plain HTTP only with `plain_http`, or for a
  loopback registry that does not speak TLS (Docker's rule for localhost);
- no credential is ever logged or put in an exception message.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import queue
import ssl
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urljoin, urlsplit

import aiohttp

from wakegate.control.delivery import media
from wakegate.control.delivery.credentials import Credentials, DockerAuths, parse_challenge, parse_docker_config
from wakegate.control.delivery.digests import Digester, FileDigests, digest_of
from wakegate.control.delivery.errors import DigestMismatch, ManifestError, RegistryError
from wakegate.control.delivery.progress import Tracker

log = logging.getLogger("wakegate.delivery")

#: bytes read from the network per chunk, and per read of a file being pushed
CHUNK = 1024 * 1024
#: chunks a blob's writer thread may lag behind the network
WRITE_QUEUE = 16
MAX_REDIRECTS = 5
#: the longest error body kept for a message
ERROR_BODY = 512


@dataclass(frozen=True)
class RegistrySettings:
    """How registries are reached; one per process."""

    docker_config: Path | None = None
    """Docker config with `auths`; None: $DOCKER_CONFIG/config.json, then ~/.docker/config.json."""
    ca_file: Path | None = None
    """Extra CA certificates (PEM) trusted for registries, next to the system's."""
    plain_http: bool = False
    """Speak plain HTTP to every registry (only for registries on a trusted network)."""
    connect_timeout: float = 5.0
    """Seconds to connect: a registry that is down fails within this long."""
    read_timeout: float = 60.0
    """Seconds without a byte before a transfer counts as broken."""
    retries: int = 3
    """Resumes of a broken blob transfer before giving up."""


def default_docker_config() -> Path | None:
    base = os.environ.get("DOCKER_CONFIG")
    for path in ([Path(base) / "config.json"] if base else []) + [Path.home() / ".docker" / "config.json"]:
        if path.is_file():
            return path
    return None


def load_auths(path: Path | None) -> DockerAuths:
    """Credentials from a Docker config file (none when there is no file); what cannot be used
    is logged once as a warning, without any secret."""
    if path is None:
        return DockerAuths()
    try:
        text = path.read_text()
    except OSError as exc:
        raise RegistryError(f"cannot read the registry config {path}: {exc.strerror}", "bad_config") from None
    try:
        auths = parse_docker_config(text, str(path))
    except ValueError as exc:
        raise RegistryError(str(exc), "bad_config") from None
    for line in auths.unsupported:
        log.warning("registry credentials: %s", line)
    return auths


def _is_loopback(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    name = name.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _error_text(status: int, body: bytes) -> str:
    """The registry's own error message (OCI `errors[0].message`), else the status."""
    try:
        errors = json.loads(body[:ERROR_BODY * 8]).get("errors") or []
        first = errors[0]
        return f"HTTP {status} {first.get('code', '')}: {first.get('message', '')}"[:ERROR_BODY]
    except (ValueError, AttributeError, IndexError, TypeError):
        return f"HTTP {status}"


class _BlobWriter:
    """Writes a blob's chunks and hashes them, in order, behind bounded queues: one thread writes
    and computes the whole-file digest, another the block table, so the two hashes use two cores."""

    def __init__(self, fd: int, digester: Digester) -> None:
        self._fd = fd
        self._digester = digester
        self._queues: list[queue.Queue[bytes | None]] = [queue.Queue(WRITE_QUEUE), queue.Queue(WRITE_QUEUE)]
        self._error: BaseException | None = None
        self._threads = [
            threading.Thread(target=self._run, args=(self._queues[0], self._write), name="blob-writer", daemon=True),
            threading.Thread(target=self._run, args=(self._queues[1], digester.update_blocks), name="blob-blocks",
                             daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _write(self, chunk: bytes) -> None:
        view = memoryview(chunk)
        while view:
            view = view[os.write(self._fd, view):]
        self._digester.update_whole(chunk)

    def _run(self, chunks: queue.Queue[bytes | None], work: Callable[[bytes], None]) -> None:
        while (chunk := chunks.get()) is not None:
            if self._error is not None:
                continue
            try:
                work(chunk)
            except BaseException as exc:  # handed to the event loop in close()
                self._error = exc

    async def put(self, chunk: bytes) -> None:
        for chunks in self._queues:
            try:
                chunks.put_nowait(chunk)
            except queue.Full:
                await asyncio.to_thread(chunks.put, chunk)

    async def close(self) -> None:
        for chunks in self._queues:
            await asyncio.to_thread(chunks.put, None)
        for thread in self._threads:
            await asyncio.to_thread(thread.join)
        if self._error is not None:
            raise self._error


Body = Callable[[], Any]


class RegistryClient:
    """One registry host. Use as `async with RegistryClient(host, settings) as client:`."""

    def __init__(self, host: str, settings: RegistrySettings = RegistrySettings(),
                 auths: DockerAuths | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.host = host
        self._settings = settings
        if auths is None:
            auths = load_auths(settings.docker_config or default_docker_config())
        self._credentials: Credentials | None = auths.for_host(host)
        self._clock = clock
        self._scheme = "http" if settings.plain_http else "https"
        #: Authorization header per scope ("*" for Basic, which holds for every scope)
        self._authorization: dict[str, str] = {}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _ssl(self) -> ssl.SSLContext:
        context = ssl.create_default_context()
        if self._settings.ca_file:
            try:
                context.load_verify_locations(cafile=str(self._settings.ca_file))
            except (OSError, ssl.SSLError) as exc:
                raise RegistryError(f"cannot load the CA file {self._settings.ca_file}: {exc}", "bad_config") from None
        return context

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(
                total=None, sock_connect=self._settings.connect_timeout, sock_read=self._settings.read_timeout
            )
            connector = aiohttp.TCPConnector(ssl=self._ssl(), limit=8)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=timeout, auto_decompress=False, trust_env=True,
                headers={"User-Agent": "wakegate-delivery"},
            )
        return self._session

    def _url(self, path: str) -> str:
        return f"{self._scheme}://{self.host}{path}"

    @staticmethod
    def _scope(repository: str, push: bool) -> str:
        return f"repository:{repository}:{'pull,push' if push else 'pull'}"

    # -- requests, auth and errors ------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _request(self, method: str, path: str, repository: str, *, push: bool = False,
                       headers: dict[str, str] | None = None, body: Body | None = None,
                       ok: tuple[int, ...] = (200,), scope: str | None = None,
                       ) -> AsyncIterator[aiohttp.ClientResponse]:
        """One request to this registry's API, authenticated as the registry asks; a status not in
        `ok` is a RegistryError (404 `not_found`, 401/403 `unauthorized`). `scope` replaces the
        repository's token scope (`registry:catalog:*` for the catalog)."""
        scope = scope or self._scope(repository, push)
        answered_challenge = False
        while True:
            resp = await self._send(method, path, scope, headers or {}, body)
            if resp.status == 401 and not answered_challenge:
                challenge = resp.headers.get("WWW-Authenticate", "")
                resp.release()
                answered_challenge = True
                if await self._answer(challenge, scope):
                    continue
                raise RegistryError(
                    f"registry {self.host} asks for credentials for {repository} and none are configured "
                    "(an `auths` entry in the Docker config)", "unauthorized")
            if resp.status not in ok:
                text = _error_text(resp.status, await resp.read())
                resp.release()
                reason = {401: "unauthorized", 403: "unauthorized", 404: "not_found"}.get(resp.status, "registry_error")
                if resp.status in (401, 403):
                    text += " (credentials refused)" if self._credentials else " (no credentials configured)"
                raise RegistryError(f"registry {self.host}: {method} {path}: {text}", reason)
            try:
                yield resp
            finally:
                resp.release()
            return

    async def _send(self, method: str, path_or_url: str, scope: str, headers: dict[str, str],
                    body: Body | None) -> aiohttp.ClientResponse:
        """Send, following redirects by hand: the Authorization header goes to this registry only."""
        url = path_or_url if "://" in path_or_url else self._url(path_or_url)
        for _ in range(MAX_REDIRECTS + 1):
            own = urlsplit(url).netloc == self.host
            sent = dict(headers)
            authorization = self._authorization.get(scope) or self._authorization.get("*")
            if own and authorization:
                sent["Authorization"] = authorization
            try:
                resp = await self._http().request(method, url, headers=sent, data=body() if body else None,
                                                  allow_redirects=False)
            except aiohttp.ClientConnectorCertificateError as exc:
                raise RegistryError(
                    f"registry {self.host}: its TLS certificate is not trusted ({_short(exc.certificate_error)}); "
                    "give its CA with --registry-ca-file", "unreachable") from None
            except (aiohttp.ClientSSLError, aiohttp.ClientConnectorError) as exc:
                if not _tls_failure(exc):
                    raise RegistryError(f"registry {self.host} is unreachable: {_short(exc)}", "unreachable") from None
                if own and self._scheme == "https" and _is_loopback(self.host):
                    # A loopback registry without TLS: speak plain HTTP to it from now on.
                    self._scheme = "http"
                    url = self._url(urlsplit(url).path + (f"?{urlsplit(url).query}" if urlsplit(url).query else ""))
                    continue
                raise RegistryError(f"registry {self.host}: TLS handshake failed (is --registry-ca-file needed?)",
                                    "unreachable") from None
            except (TimeoutError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                raise RegistryError(f"registry {self.host} is unreachable: {_short(exc)}", "unreachable") from None
            if resp.status in (301, 302, 303, 307, 308) and "Location" in resp.headers:
                url = urljoin(url, resp.headers["Location"])
                resp.release()
                if resp.status == 303:
                    method, body = "GET", None
                continue
            return resp
        raise RegistryError(f"registry {self.host}: more than {MAX_REDIRECTS} redirects", "registry_error")

    async def _answer(self, header: str, scope: str) -> bool:
        """Take up the registry's challenge; True when there is a new Authorization to try."""
        challenge = parse_challenge(header)
        if challenge.scheme == "basic":
            if self._credentials is None:
                return False
            self._authorization["*"] = self._credentials.basic()
            return True
        if challenge.scheme == "bearer" and "realm" in challenge.params:
            self._authorization[scope] = "Bearer " + await self._token(challenge.params, scope)
            return True
        return False

    async def _token(self, params: dict[str, str] | Any, scope: str) -> str:
        realm = params["realm"]
        realm_parts = urlsplit(realm)
        if realm_parts.scheme not in ("http", "https"):
            raise RegistryError(f"registry {self.host}: token realm is not an HTTP URL", "registry_error")
        query = {"scope": params.get("scope") or scope}
        if params.get("service"):
            query["service"] = params["service"]
        headers: dict[str, str] = {}
        if self._credentials is not None:
            if realm_parts.scheme == "https" or _is_loopback(realm_parts.netloc):
                headers["Authorization"] = self._credentials.basic()
            else:
                log.warning("registry %s: token realm %s is plain HTTP; asking for a token without credentials",
                            self.host, realm_parts.netloc)
        url = f"{realm}{'&' if realm_parts.query else '?'}{urlencode(query)}"
        try:
            async with self._http().get(url, headers=headers) as resp:
                body = await resp.read()
                if resp.status != 200:
                    reason = "unauthorized" if resp.status in (401, 403) else "registry_error"
                    raise RegistryError(
                        f"registry {self.host}: token service {realm_parts.netloc} answered HTTP {resp.status}"
                        + (" (credentials refused)" if self._credentials and reason == "unauthorized" else ""), reason)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise RegistryError(f"token service {realm_parts.netloc} is unreachable: {_short(exc)}",
                                "unreachable") from None
        try:
            doc = json.loads(body)
            token = doc.get("token") or doc.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token:
            raise RegistryError(f"registry {self.host}: the token service gave no token", "registry_error")
        return token

    # -- pull -----------------------------------------------------------------------------------

    async def manifest(self, repository: str, reference: str) -> tuple[str, media.Manifest | media.Index, bytes]:
        """(digest, parsed, bytes) of a manifest by tag or digest; a digest reference is verified."""
        async with self._request("GET", f"/v2/{repository}/manifests/{reference}", repository,
                                 headers={"Accept": media.ACCEPT}) as resp:
            body = await resp.content.read(media.MAX_MANIFEST_BYTES + 1)
            content_type = resp.headers.get("Content-Type")
        algorithm = reference.partition(":")[0] if reference.startswith(("sha256:", "sha512:")) else "sha256"
        digest = digest_of(body, algorithm)
        if reference.startswith(("sha256:", "sha512:")) and digest != reference:
            raise DigestMismatch(f"manifest {repository}@{reference}: the registry sent bytes with digest {digest}")
        return digest, media.parse(body, content_type), body

    async def model_manifest(self, repository: str, reference: str) -> tuple[str, media.Manifest, bytes]:
        """The image manifest a model is pulled from, through an index if the reference names one."""
        digest, parsed, body = await self.manifest(repository, reference)
        if isinstance(parsed, media.Index):
            chosen = media.choose(parsed)
            digest, parsed, body = await self.manifest(repository, chosen.digest)
            if isinstance(parsed, media.Index):
                raise ManifestError(f"{repository}@{chosen.digest}: an index inside an index is not supported")
        return digest, parsed, body

    async def blob_bytes(self, repository: str, descriptor: media.Descriptor, limit: int = 4 * 1024 * 1024) -> bytes:
        """A small blob (a config) in memory, verified."""
        if descriptor.size > limit:
            raise ManifestError(f"blob {descriptor.digest} is {descriptor.size} bytes, more than {limit}")
        async with self._request("GET", f"/v2/{repository}/blobs/{descriptor.digest}", repository) as resp:
            body = await resp.content.read(limit + 1)
        checker = Digester(descriptor.digest)
        checker.update(body)
        checker.verify(descriptor.digest, f"blob {descriptor.digest}")
        return body

    async def fetch_blob(self, repository: str, descriptor: media.Descriptor, dest: Path,
                         tracker: Tracker | None = None) -> FileDigests:
        """Stream a blob into `dest`, resuming from what `dest` already holds, and verify it.

        A digest mismatch removes `dest` (its bytes are wrong, not merely short)."""
        digester = Digester(descriptor.digest)
        fd = os.open(dest, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            have = os.fstat(fd).st_size
            if have > descriptor.size:
                os.ftruncate(fd, 0)
                have = 0
            if have:
                await asyncio.to_thread(_hash_prefix, fd, have, digester)
            os.lseek(fd, have, os.SEEK_SET)
            if tracker and have:
                log.info("registry %s: resuming blob %s at %d of %d bytes", self.host, descriptor.digest, have,
                         descriptor.size)
                tracker.set_done(tracker.current.done + have, self._clock(), force=True)
            failures = 0
            while digester.size < descriptor.size:
                try:
                    await self._receive(repository, descriptor, fd, digester, tracker)
                except _Restart:
                    # The registry answered the range request with other bytes: start over.
                    os.ftruncate(fd, 0)
                    os.lseek(fd, 0, os.SEEK_SET)
                    digester = Digester(descriptor.digest)
                    if tracker:
                        tracker.set_done(0, self._clock())
                    failures += 1
                    if failures > self._settings.retries:
                        raise RegistryError(f"registry {self.host}: blob {descriptor.digest} cannot be resumed",
                                            "registry_error") from None
                except _Broken as exc:
                    failures += 1
                    if failures > self._settings.retries:
                        raise RegistryError(
                            f"registry {self.host}: blob {descriptor.digest} broke off {failures} times "
                            f"({exc}); {digester.size} of {descriptor.size} bytes kept for a later resume",
                            "unreachable") from None
                    log.warning("registry %s: blob %s broke off at %d bytes (%s); resuming", self.host,
                                descriptor.digest, digester.size, exc)
                    await asyncio.sleep(min(2.0, 0.25 * 2**failures))
                if digester.size == 0 and descriptor.size == 0:
                    break
            await asyncio.to_thread(os.fsync, fd)
        finally:
            os.close(fd)
        try:
            return digester.verify(descriptor.digest, f"blob {descriptor.digest} from {self.host}/{repository}")
        except DigestMismatch:
            await asyncio.to_thread(dest.unlink, missing_ok=True)
            raise

    async def _receive(self, repository: str, descriptor: media.Descriptor, fd: int, digester: Digester,
                       tracker: Tracker | None) -> None:
        start = digester.size
        headers = {"Range": f"bytes={start}-"} if start else {}
        try:
            async with self._request("GET", f"/v2/{repository}/blobs/{descriptor.digest}", repository,
                                     headers=headers, ok=(200, 206)) as resp:
                if resp.status == 200 and start:
                    raise _Restart
                if resp.status == 206 and not resp.headers.get("Content-Range", "").startswith(f"bytes {start}-"):
                    raise _Restart
                writer = _BlobWriter(fd, digester)
                received = start
                try:
                    async for chunk in resp.content.iter_chunked(CHUNK):
                        received += len(chunk)
                        if received > descriptor.size:
                            raise DigestMismatch(
                                f"blob {descriptor.digest}: the registry sent more than its {descriptor.size} bytes")
                        await writer.put(chunk)
                        if tracker:
                            tracker.advance(len(chunk), self._clock())
                finally:
                    await writer.close()
                if received < descriptor.size:
                    raise _Broken(f"the response ended at {received} bytes")
        except (TimeoutError, aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
                aiohttp.ClientOSError) as exc:
            raise _Broken(_short(exc)) from None

    # -- listing --------------------------------------------------------------------------------

    async def repositories(self, page: int = 100, limit: int = 10_000) -> list[str]:
        """Every repository the registry lists (`GET /v2/_catalog`), page by page through its
        `Link` headers; at most `limit` names (a RegistryError `too_many` past that)."""
        return await self._paged("/v2/_catalog", "repositories", "registry:catalog:*", "the catalog", page, limit)

    async def tags(self, repository: str, page: int = 100, limit: int = 1_000) -> list[str]:
        """The tags of `repository` (`GET /v2/<name>/tags/list`), paged like `repositories`."""
        return await self._paged(f"/v2/{repository}/tags/list", "tags", self._scope(repository, False),
                                 f"the tags of {repository}", page, limit)

    async def _paged(self, path: str, key: str, scope: str, what: str, page: int, limit: int) -> list[str]:
        names: list[str] = []
        target: str | None = f"{path}?{urlencode({'n': page})}"
        seen: set[str] = set()
        while target is not None:
            if target in seen:
                raise RegistryError(f"registry {self.host}: {what}: the next page repeats a page", "registry_error")
            seen.add(target)
            async with self._request("GET", target, what, scope=scope) as resp:
                body = await resp.content.read(media.MAX_MANIFEST_BYTES + 1)
                link = resp.headers.get("Link", "")
            page_names = media.listed_names(body, key, f"registry {self.host}: {what}")
            names.extend(page_names)
            if len(names) > limit:
                raise RegistryError(f"registry {self.host}: {what} has more than {limit} entries", "too_many")
            following = media.next_page(link)
            if following is not None and not page_names:
                raise RegistryError(f"registry {self.host}: {what}: an empty page points to another", "registry_error")
            if following is not None:
                # Only this registry's own API is followed; the link is relative or names this host.
                parts = urlsplit(following)
                if parts.netloc and parts.netloc != self.host:
                    raise RegistryError(f"registry {self.host}: {what}: the next page is on another host",
                                        "registry_error")
                following = parts.path + (f"?{parts.query}" if parts.query else "")
            target = following
        return names

    # -- push -----------------------------------------------------------------------------------

    async def has_blob(self, repository: str, digest: str) -> bool:
        try:
            async with self._request("HEAD", f"/v2/{repository}/blobs/{digest}", repository, push=True):
                return True
        except RegistryError as exc:
            if exc.reason == "not_found":
                return False
            raise

    async def push_blob(self, repository: str, digest: str, size: int,
                        chunks: Callable[[], AsyncIterator[bytes]]) -> None:
        """Upload a blob (monolithic: one POST, one PUT) unless the registry has it already."""
        if await self.has_blob(repository, digest):
            return
        async with self._request("POST", f"/v2/{repository}/blobs/uploads/", repository, push=True,
                                 ok=(202,)) as resp:
            location = resp.headers.get("Location")
        if not location:
            raise RegistryError(f"registry {self.host}: upload started without a Location", "registry_error")
        target = urljoin(self._url(f"/v2/{repository}/blobs/uploads/"), location)
        target += ("&" if urlsplit(target).query else "?") + urlencode({"digest": digest})
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        async with self._request("PUT", target, repository, push=True, headers=headers, body=chunks, ok=(201,)):
            pass

    async def push_manifest(self, repository: str, reference: str, body: bytes, media_type: str) -> str:
        """Put a manifest under a tag (or its digest); returns its digest."""
        async with self._request("PUT", f"/v2/{repository}/manifests/{reference}", repository, push=True,
                                 headers={"Content-Type": media_type}, body=lambda: body, ok=(201,)):
            pass
        return digest_of(body)


class _Broken(Exception):
    """A transfer that ended early; resumable."""


class _Restart(Exception):
    """The registry answered a range request with other bytes; the transfer starts over."""


def _hash_prefix(fd: int, size: int, digester: Digester) -> None:
    offset = 0
    while offset < size:
        chunk = os.pread(fd, min(8 * CHUNK, size - offset), offset)
        if not chunk:
            break
        digester.update(chunk)
        offset += len(chunk)


def _tls_failure(exc: BaseException) -> bool:
    return isinstance(exc, aiohttp.ClientSSLError) or (
        isinstance(exc, aiohttp.ClientConnectorError) and isinstance(exc.os_error, ssl.SSLError))


def _short(exc: BaseException) -> str:
    """An exception as a short phrase without headers or URLs' queries."""
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return exc.os_error.strerror or type(exc.os_error).__name__
    text = str(exc).split("\n", 1)[0]
    return f"{type(exc).__name__}: {text}"[:200] if text else type(exc).__name__

