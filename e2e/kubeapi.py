"""A small asyncio REST client for kube-apiserver, enough for the node agent.

The agent handles raw JSON (it writes pod status field by field, as a kubelet
does), so the typed kubernetes client would only add conversions.
"""

from __future__ import annotations

import base64
import json
import ssl
import tempfile
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import yaml

JSON = dict[str, Any]


class ApiError(RuntimeError):
    def __init__(self, status: int, body: str, method: str, path: str) -> None:
        super().__init__(f"{method} {path}: {status} {body[:500]}")
        self.status = status
        self.body = body


class WatchExpired(Exception):
    """The resourceVersion a watch started from is gone (410); relist."""


class Kubeconfig:
    """Server, CA and client credentials from a kubeconfig's current context."""

    def __init__(self, path: Path) -> None:
        self.path = path
        config = yaml.safe_load(path.read_text())
        ctx_name = config["current-context"]
        ctx = next(c["context"] for c in config["contexts"] if c["name"] == ctx_name)
        cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == ctx["cluster"])
        user = next(u["user"] for u in config["users"] if u["name"] == ctx["user"])
        self.server: str = cluster["server"].rstrip("/")
        self.ca_pem = self._pem(cluster, "certificate-authority")
        self.cert_pem = self._pem(user, "client-certificate")
        self.key_pem = self._pem(user, "client-key")
        self.token: str | None = user.get("token")

    def _pem(self, section: Mapping[str, Any], key: str) -> bytes | None:
        if f"{key}-data" in section:
            return base64.b64decode(section[f"{key}-data"])
        if key in section:
            return (self.path.parent / str(section[key])).read_bytes()
        return None

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context()
        if self.ca_pem:
            ctx.load_verify_locations(cadata=self.ca_pem.decode())
        if self.cert_pem and self.key_pem:
            # load_cert_chain only takes files; they live just long enough to load.
            with tempfile.TemporaryDirectory() as tmp:
                cert, key = Path(tmp) / "c.pem", Path(tmp) / "k.pem"
                cert.write_bytes(self.cert_pem)
                key.write_bytes(self.key_pem)
                ctx.load_cert_chain(str(cert), str(key))
        return ctx


class KubeAPI:
    def __init__(self, kubeconfig: Path) -> None:
        self.config = Kubeconfig(kubeconfig)
        self._ssl = self.config.ssl_context()
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> KubeAPI:
        headers = {"Accept": "application/json", "User-Agent": "wakegate-e2e-nodeagent"}
        if self.config.token:
            headers["Authorization"] = f"Bearer {self.config.token}"
        self._session = aiohttp.ClientSession(
            base_url=self.config.server,
            headers=headers,
            connector=aiohttp.TCPConnector(ssl=self._ssl, limit=20),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "use `async with KubeAPI(...)`"
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> JSON:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        async with self.session.request(
            method, path, data=data, params=params, headers=headers,
            timeout=aiohttp.ClientTimeout(total=30),
        ) as resp:
            text = await resp.text()
            if resp.status >= 400:
                raise ApiError(resp.status, text, method, path)
            result: JSON = json.loads(text) if text else {}
            return result

    async def get(self, path: str, params: Mapping[str, str] | None = None) -> JSON:
        return await self.request("GET", path, params=params)

    async def create(self, path: str, body: JSON) -> JSON:
        return await self.request("POST", path, body)

    async def merge_patch(self, path: str, body: JSON) -> JSON:
        return await self.request("PATCH", path, body, content_type="application/merge-patch+json")

    async def delete(self, path: str, body: JSON | None = None) -> JSON:
        return await self.request("DELETE", path, body)

    async def watch(self, path: str, resource_version: str, params: Mapping[str, str] | None = None
                    ) -> AsyncIterator[tuple[str, JSON]]:
        """Yield (type, object) events until the server ends the watch."""
        query = {
            **(params or {}),
            "watch": "1",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": "300",
        }
        async with self.session.get(
            path, params=query, timeout=aiohttp.ClientTimeout(total=None, sock_read=330)
        ) as resp:
            if resp.status == 410:
                raise WatchExpired()
            if resp.status >= 400:
                raise ApiError(resp.status, await resp.text(), "WATCH", path)
            # One JSON event per line; lines can exceed aiohttp's default chunk.
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if event["type"] == "ERROR":
                        if event["object"].get("code") == 410:
                            raise WatchExpired()
                        raise ApiError(event["object"].get("code", 500), json.dumps(event["object"]),
                                       "WATCH", path)
                    yield event["type"], event["object"]
