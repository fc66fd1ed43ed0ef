"""Talking to member gateways over HTTP(S): the status probe and the one wake request.

Both go to the member's public listener with the member's bearer token (a file named by the
Cluster, read on every call so a rotated token applies at once; never logged). The probe is
`GET /wakegate/status`; a wake is `GET /model/<name>/v1/models`, which the member's own
extproc holds while the model starts (its cold path registers the demand that wakes it there)
and then hands to the engine, whose model list answers it: an activation that costs the
engine no generation.

An https:// member is verified as the global Envoy verifies it: against the Cluster's CA, the
SAN being its `serverName` (also sent as SNI) or else the URL's IP, with the client
certificate where the Cluster names one (`client_context`). The material is PEM text read on
every probe (a rotated one applies at once) and never logged; a problem with it is one line.
"""

from __future__ import annotations

import os
import ssl
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

from wakegate.contract import MODEL_PATH_PREFIX, STATUS_PATH
from wakegate.control.federation.members import MAX_STATUS_BYTES, MemberReport, parse_status


class ProbeFailed(Exception):
    """A member gateway did not answer as one should; the message is one short line."""


def read_token(token_file: Path | None) -> str | None:
    """The member token in `token_file` (read on every call: a rotated one applies at once)."""
    if token_file is None:
        return None
    try:
        return token_file.read_text(encoding="utf-8").strip() or None
    except OSError as exc:
        raise ProbeFailed(f"cannot read the member token file {token_file}: {exc.strerror}") from None


@dataclass(frozen=True, repr=False)
class TlsMaterial:
    """What verifies a member gateway and, for mTLS, identifies us to it: PEM text (never shown)."""

    ca: str
    cert: str | None = None
    key: str | None = None


@dataclass(frozen=True)
class TlsFiles:
    """Where a member's TLS material is on this machine (`caFile`, `clientCertFile`, `clientKeyFile`)."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None

    def read(self) -> TlsMaterial:
        """The files' contents now; ProbeFailed naming the file that cannot be read."""

        def text(path: Path, what: str) -> str:
            try:
                return path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) else "not PEM text"
                raise ProbeFailed(f"tls: cannot read the {what} file {path}: {reason}") from None

        return TlsMaterial(
            text(self.ca, "CA"),
            text(self.cert, "client certificate") if self.cert else None,
            text(self.key, "client key") if self.key else None,
        )


def client_context(material: TlsMaterial) -> ssl.SSLContext:
    """A client context that trusts only `material.ca` and presents its client certificate;
    ProbeFailed (one line, no material) when the material does not load."""
    try:
        context = ssl.create_default_context(cadata=material.ca)
    except (ssl.SSLError, ValueError):
        raise ProbeFailed("tls: the CA is not a PEM certificate bundle") from None
    if material.cert is not None and material.key is not None:
        # The ssl module loads a certificate and key from files only: a private folder, gone at once.
        with tempfile.TemporaryDirectory(prefix="wakegate-tls-") as folder:
            cert, key = Path(folder) / "cert.pem", Path(folder) / "key.pem"
            for path, text in ((cert, material.cert), (key, material.key)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w", encoding="utf-8") as out:
                    out.write(text)
            try:
                context.load_cert_chain(cert, key)
            except (ssl.SSLError, ValueError):
                raise ProbeFailed("tls: the client certificate and key do not load as a PEM pair") from None
    return context


def _headers(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


@dataclass(frozen=True)
class Tls:
    """How one request verifies an https:// member: the context and the name its certificate has."""

    context: ssl.SSLContext
    server_name: str | None = None
    #: The context presents a client certificate (mTLS).
    client_cert: bool = False

    @classmethod
    def of(cls, material: TlsMaterial, server_name: str | None) -> Tls:
        """The context for `material` (ProbeFailed when it does not load)."""
        return cls(client_context(material), server_name, material.cert is not None and material.key is not None)


async def _get(
    session: aiohttp.ClientSession, url: str, token: str | None, timeout: float, what: str, tls: Tls | None = None
) -> tuple[int, bytes]:
    """One GET to a member gateway: its status and (at most MAX_STATUS_BYTES + 1 of) its body."""
    extra: dict[str, Any] = {}
    if tls is not None:
        extra["ssl"] = tls.context
        if tls.server_name is not None:
            extra["server_hostname"] = tls.server_name
    try:
        async with session.get(
            url, headers=_headers(token), timeout=aiohttp.ClientTimeout(total=timeout), **extra
        ) as answer:
            return answer.status, await answer.content.read(MAX_STATUS_BYTES + 1)
    except aiohttp.ClientConnectorCertificateError as exc:
        error = exc.certificate_error
        reason = getattr(error, "verify_message", None) or getattr(error, "reason", None) or type(error).__name__
        raise ProbeFailed(f"{what}: the gateway's certificate was refused: {reason}") from None
    except aiohttp.ClientSSLError as exc:
        reason = getattr(exc.os_error, "reason", None) or type(exc.os_error).__name__
        raise ProbeFailed(f"{what}: TLS handshake failed: {reason}") from None
    except (aiohttp.ClientError, OSError) as exc:
        refused = _tls_alert(exc)
        if refused is None and tls is not None and isinstance(exc, aiohttp.ClientOSError):
            refused = exc.strerror or type(exc).__name__  # the alert lost to a reset that followed it
        if refused is not None:  # e.g. a gateway that requires a client certificate we lack
            hint = " (no client certificate was presented)" if tls is not None and not tls.client_cert else ""
            raise ProbeFailed(f"{what}: the gateway refused the TLS connection: {refused}{hint}") from None
        raise ProbeFailed(f"{what}: unreachable: {type(exc).__name__}") from None
    except TimeoutError:
        raise ProbeFailed(f"{what}: no answer in {timeout:g}s") from None


def _tls_alert(exc: BaseException) -> str | None:
    """The reason of a TLS error behind `exc` (an alert the gateway sent after the handshake)."""
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None:
            return None
        if isinstance(seen, ssl.SSLError):
            return str(seen.reason or type(seen).__name__)
        seen = seen.__cause__ or seen.__context__
    return None


async def probe(
    session: aiohttp.ClientSession, url: str, token: str | None, timeout: float, tls: Tls | None = None
) -> tuple[MemberReport, float]:
    """The member's report and how long it took, seconds; ProbeFailed otherwise."""
    started = time.monotonic()
    status, body = await _get(session, url + STATUS_PATH, token, timeout, "probe", tls)
    if status != 200:
        raise ProbeFailed(f"probe: status {status} from {STATUS_PATH}")
    try:
        report = parse_status(body)
    except ValueError as exc:
        raise ProbeFailed(f"probe: {exc}") from None
    return report, time.monotonic() - started


async def wake(
    session: aiohttp.ClientSession, url: str, token: str | None, model: str, timeout: float, tls: Tls | None = None
) -> None:
    """Ask one member to wake `model`; returns once the member's engine answered. ProbeFailed otherwise."""
    path = f"{MODEL_PATH_PREFIX}{quote(model, safe='')}/v1/models"
    status, _ = await _get(session, url + path, token, timeout, "wake", tls)
    if status != 200:
        raise ProbeFailed(f"wake: answered {status}")
