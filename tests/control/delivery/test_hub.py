"""`hf://` against a local stand-in for the Hugging Face Hub: no Hub is reachable from here, so
this checks the exact requests `huggingface_hub` makes for us (endpoint from $HF_ENDPOINT, the
token from the environment on every request), and what we do with the answers (files checked
against the listing's SHA-256 and git blob ids, a commit served from the cache afterwards)."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from wakegate.control.delivery.cache import Cache
from wakegate.control.delivery.errors import DeliveryError
from wakegate.control.delivery.resolver import Access, Resolved, resolve

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_test_token_not_a_real_one"


@dataclass
class FakeHub:
    files: dict[str, bytes]
    lfs: set[str]
    url: str = ""
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    """(method, path with query, Authorization header) in arrival order."""
    wrong_sha: bool = False

    def sibling(self, name: str) -> dict[str, object]:
        data = self.files[name]
        out: dict[str, object] = {
            "rfilename": name,
            "size": len(data),
            "blobId": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(),
        }
        if name in self.lfs:
            sha = hashlib.sha256(data).hexdigest() if not self.wrong_sha else "0" * 64
            out["lfs"] = {"sha256": sha, "size": len(data), "pointerSize": 134}
        return out

    async def info(self, request: web.Request) -> web.Response:
        self._record(request)
        if request.match_info["repo"] != "org/tiny":
            return web.json_response(
                {"error": "Repository not found"}, status=404, headers={"X-Error-Code": "RepoNotFound"}
            )
        return web.json_response(
            {
                "id": "org/tiny",
                "modelId": "org/tiny",
                "sha": COMMIT,
                "private": False,
                "siblings": [self.sibling(n) for n in sorted(self.files)],
            }
        )

    async def resolve_file(self, request: web.Request) -> web.StreamResponse:
        self._record(request)
        name = request.match_info["path"]
        if request.match_info["revision"] != COMMIT or name not in self.files:
            return web.Response(status=404, headers={"X-Error-Code": "EntryNotFound"})
        data = self.files[name]
        etag = hashlib.sha256(data).hexdigest() if name in self.lfs else hashlib.sha1(data).hexdigest()
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"', "Content-Length": str(len(data))}
        if request.method == "HEAD":
            return web.Response(headers=headers)
        return web.Response(body=data, headers=headers)

    def _record(self, request: web.Request) -> None:
        self.requests.append((request.method, request.path_qs, request.headers.get("Authorization")))


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with serving(FakeHub({"model.gguf": bytes(range(256)) * 4096, "config.json": b'{"a": 1}'}, {"model.gguf"})) as fake:
        yield fake


@contextmanager
def serving(fake: FakeHub) -> Iterator[FakeHub]:
    """`fake` answering on a loopback port (its `url`) from a thread of its own, as repository
    `org/tiny` at COMMIT."""
    app = web.Application()
    app.router.add_get("/api/models/{repo:.+}/revision/{revision}", fake.info)
    app.router.add_route("*", "/{repo:[^/]+/[^/]+}/resolve/{revision}/{path:.+}", fake.resolve_file)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    fake.url = f"http://127.0.0.1:{port}"
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield fake
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.run_until_complete(runner.cleanup())
    loop.close()


def pull(source: str, cache: Cache, monkeypatch: pytest.MonkeyPatch, hub: FakeHub) -> Resolved:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    return asyncio.run(resolve(source, cache, access=Access.from_env()))


def test_a_hub_snapshot_lands_in_the_cache_with_exactly_these_requests(
    tmp_path: Path, hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = Cache(tmp_path / "cache")
    resolved = pull("hf://org/tiny@main", cache, monkeypatch, hub)
    assert resolved.pulled and resolved.primary is not None
    assert resolved.primary.read_bytes() == hub.files["model.gguf"]
    assert (resolved.root / "config.json").read_bytes() == hub.files["config.json"]
    assert resolved.record is not None and resolved.record.source == f"hf://org/tiny@{COMMIT}"
    assert {f.path: f.digest for f in resolved.record.files}["model.gguf"] == (
        "sha256:" + hashlib.sha256(hub.files["model.gguf"]).hexdigest()
    )
    resolved.release()
    assert all(auth == f"Bearer {TOKEN}" for _, _, auth in hub.requests)
    first, *files = [(m, p) for m, p, _ in hub.requests]
    # The revision's listing with file metadata, then a HEAD and a GET per file at the commit
    # (files are fetched four at a time, so their order varies).
    assert first == ("GET", "/api/models/org/tiny/revision/main?blobs=true")
    assert sorted(files) == sorted(
        (method, f"/org/tiny/resolve/{COMMIT}/{name}") for name in hub.files for method in ("GET", "HEAD")
    )

    hub.requests.clear()
    pinned = pull(f"hf://org/tiny@{COMMIT}", cache, monkeypatch, hub)
    assert not pinned.pulled and pinned.record == resolved.record and hub.requests == []
    pinned.release()


def test_a_file_filter_fetches_only_matching_files(
    tmp_path: Path, hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    resolved = pull("hf://org/tiny/*.gguf", Cache(tmp_path / "cache"), monkeypatch, hub)
    assert resolved.files == ("model.gguf",)
    assert not any("config.json" in p for _, p, _ in hub.requests)
    resolved.release()


def test_bytes_that_disagree_with_the_listing_are_refused(
    tmp_path: Path, hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.wrong_sha = True
    cache = Cache(tmp_path / "cache")
    with pytest.raises(DeliveryError) as err:
        pull("hf://org/tiny", cache, monkeypatch, hub)
    assert err.value.reason == "digest_mismatch" and "model.gguf" in str(err.value)
    assert cache.keys() == []


def test_an_unknown_repository_is_not_found_and_the_token_is_not_in_the_error(
    tmp_path: Path, hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(DeliveryError) as err:
        pull("hf://org/missing", Cache(tmp_path / "cache"), monkeypatch, hub)
    assert err.value.reason == "not_found" and "hf://org/missing@main" in str(err.value)
    assert TOKEN not in str(err.value)
