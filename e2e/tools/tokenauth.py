"""A Docker-style token service for the test registry: the Bearer flow, with real JWTs.

The Distribution registry's `token` auth answers an unauthenticated request with
`401 WWW-Authenticate: Bearer realm=…,service=…,scope=…`; the client asks the realm for a token
(with Basic credentials, or none), and retries with `Authorization: Bearer TOKEN`. The registry
checks the token's signature (ES256, certificate in the `x5c` header, chained to the CA in its
`rootcertbundle`), issuer, audience, expiry and granted actions. This service issues such tokens
on 127.0.0.1: every requested action to the one known user, none to anybody else (as a public
hub does for a private repository), and 401 for wrong credentials. `requests` records what each
token request carried (never the password), so tests can check the flow happened.
"""

from __future__ import annotations

import base64
import json
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from e2e.pki import PKI

ISSUER = "wakegate-test-token-issuer"
SERVICE = "wakegate-test-registry"
TOKEN_SECONDS = 300


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass(frozen=True)
class TokenRequest:
    scope: str
    service: str
    #: "basic:USER" when credentials came (and matched), "anonymous" when none did
    who: str


@dataclass
class TokenService:
    url: str
    ca: Path
    requests: list[TokenRequest] = field(default_factory=list)


def _sign(key: ec.EllipticCurvePrivateKey, cert_der: bytes, claims: dict[str, Any]) -> str:
    header = {"typ": "JWT", "alg": "ES256", "x5c": [base64.b64encode(cert_der).decode()]}
    signing_input = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"
    r, s = decode_dss_signature(key.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256())))
    return f"{signing_input}.{_b64(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"


def _access(scopes: list[str]) -> list[dict[str, Any]]:
    out = []
    for scope in scopes:
        kind, _, rest = scope.partition(":")
        name, _, actions = rest.rpartition(":")
        if kind and name:
            out.append({"type": kind, "name": name, "actions": [a for a in actions.split(",") if a]})
    return out


@contextmanager
def start_token_service(workdir: Path, user: str, password: str) -> Iterator[TokenService]:
    """Serve tokens on 127.0.0.1 until the block ends; `ca` is the registry's rootcertbundle."""
    pki = PKI(workdir / "token-pki")
    pair = pki.issue("token-signer", "wakegate-token-signer")
    loaded = serialization.load_pem_private_key(pair.key.read_bytes(), password=None)
    assert isinstance(loaded, ec.EllipticCurvePrivateKey)
    key: ec.EllipticCurvePrivateKey = loaded
    cert_der = x509.load_pem_x509_certificate(pair.cert.read_bytes()).public_bytes(serialization.Encoding.DER)
    expected = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    service = TokenService("", pki.ca.cert)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            query = parse_qs(urlsplit(self.path).query)
            scopes = query.get("scope", [])
            auth = self.headers.get("Authorization")
            if auth is not None and not secrets.compare_digest(auth.encode(), expected.encode()):
                service.requests.append(TokenRequest(" ".join(scopes), query.get("service", [""])[0], "refused"))
                self._answer(401, {"details": "wrong credentials"})
                return
            who = f"basic:{user}" if auth else "anonymous"
            service.requests.append(TokenRequest(" ".join(scopes), query.get("service", [""])[0], who))
            now = int(time.time())
            claims = {
                "iss": ISSUER, "sub": user if auth else "", "aud": SERVICE, "exp": now + TOKEN_SECONDS,
                "nbf": now - 5, "iat": now, "jti": secrets.token_hex(8),
                "access": _access(scopes) if auth else [],
            }
            self._answer(200, {"token": _sign(key, cert_der, claims), "expires_in": TOKEN_SECONDS})

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    service.url = f"http://127.0.0.1:{server.server_address[1]}/token"
    thread = threading.Thread(target=server.serve_forever, name="token-service", daemon=True)
    thread.start()
    try:
        yield service
    finally:
        server.shutdown()
        server.server_close()
