"""Pulls and pushes through the real Distribution registry: round trips with the real `oras`,
htpasswd (Basic) and token (Bearer) auth, TLS with a custom CA, digest pinning, indexes, and
failures that say what went wrong without leaking a credential."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import tarfile
from pathlib import Path

import pytest

from e2e.tools.registry import Registry, start_registry
from tests.control.delivery.conftest import weights
from wakegate.control.admin import free_port
from wakegate.control.delivery import media
from wakegate.control.delivery.cache import Cache
from wakegate.control.delivery.digests import digest_of
from wakegate.control.delivery.errors import DeliveryError
from wakegate.control.delivery.progress import Phase, Progress
from wakegate.control.delivery.pushing import push
from wakegate.control.delivery.registry import RegistryClient, RegistrySettings
from wakegate.control.delivery.resolver import Access, Policy, Resolved, resolve

pytestmark = pytest.mark.usefixtures("registry_bin", "oras_bin")


def settings(reg: Registry, anonymous: bool = False, **extra: object) -> RegistrySettings:
    return RegistrySettings(docker_config=reg.anonymous_config if anonymous else reg.docker_config, **extra)  # type: ignore[arg-type]


def pull(
    source: str, cache: Cache, reg_settings: RegistrySettings, events: list[Progress] | None = None, **options: object
) -> Resolved:
    return asyncio.run(
        resolve(
            source,
            cache,
            access=Access(registry=reg_settings),
            progress=(events.append if events is not None else lambda _: None),
            **options,
        )
    )  # type: ignore[arg-type]


def test_a_pushed_gguf_comes_back_through_oras_and_through_the_cache(tmp_path: Path) -> None:
    model = weights(tmp_path / "src")
    with start_registry(tmp_path / "reg") as reg:
        ref = f"oci://{reg.host}/models/tiny:v1"
        digest = asyncio.run(push(model, ref, settings=settings(reg)))
        out = reg.oras("pull", f"{reg.host}/models/tiny:v1", "--output", str(tmp_path / "oras"))
        assert out.returncode == 0, out.stderr
        assert (tmp_path / "oras" / "tiny.gguf").read_bytes() == model.read_bytes()
        fetched = reg.oras("manifest", "fetch", f"{reg.host}/models/tiny:v1")
        manifest = json.loads(fetched.stdout)
        assert digest == digest_of(fetched.stdout.encode())
        assert manifest["artifactType"] == media.MODEL_ARTIFACT
        assert manifest["config"]["mediaType"] == media.MODEL_CONFIG
        assert [layer["mediaType"] for layer in manifest["layers"]] == [media.WEIGHT_RAW]

        cache = Cache(tmp_path / "cache")
        events: list[Progress] = []
        resolved = pull(ref, cache, settings(reg), events)
        assert resolved.pulled and resolved.record is not None and resolved.record.key == digest
        assert resolved.model_path.read_bytes() == model.read_bytes()
        assert resolved.model_path == cache.files_dir(digest) / "tiny.gguf"
        assert {Phase.RESOLVING, Phase.PULLING, Phase.READY} <= {e.phase for e in events}
        resolved.release()
        again = pull(ref, cache, settings(reg))
        assert not again.pulled and again.model_path == resolved.model_path
        again.release()


def test_what_oras_pushes_is_pulled_files_and_directories_alike(tmp_path: Path) -> None:
    src = tmp_path / "src"
    model = weights(src)
    tokenizer = src / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text('{"v": 1}')
    with start_registry(tmp_path / "reg") as reg:
        out = reg.oras(
            "push",
            f"{reg.host}/models/plain:v1",
            "--artifact-type",
            "application/x-test",
            f"{model.name}:application/x-gguf",
            "tok",
            cwd=src,
        )
        assert out.returncode == 0, out.stderr
        resolved = pull(f"oci://{reg.host}/models/plain:v1", Cache(tmp_path / "cache"), settings(reg))
        assert sorted(resolved.files) == ["tiny.gguf", "tok/tokenizer.json"]
        assert resolved.primary is not None and resolved.primary.read_bytes() == model.read_bytes()
        assert (resolved.root / "tok" / "tokenizer.json").read_text() == '{"v": 1}'
        resolved.release()


def test_a_directory_pushed_by_wakegate_keeps_its_tree_for_oras(tmp_path: Path) -> None:
    src = tmp_path / "model"
    weights(src, 1000, "model.safetensors")
    (src / "sub").mkdir()
    (src / "sub" / "config.json").write_text("{}")
    with start_registry(tmp_path / "reg") as reg:
        asyncio.run(push(src, f"oci://{reg.host}/models/dir:v1", settings=settings(reg)))
        out = reg.oras("pull", f"{reg.host}/models/dir:v1", "--output", str(tmp_path / "oras"))
        assert out.returncode == 0, out.stderr
        assert (tmp_path / "oras" / "sub" / "config.json").read_text() == "{}"
        resolved = pull(f"oci://{reg.host}/models/dir:v1", Cache(tmp_path / "cache"), settings(reg))
        assert sorted(resolved.files) == ["model.safetensors", "sub/config.json"]
        resolved.release()


def test_htpasswd_auth_pulls_with_credentials_and_refuses_without(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    model = weights(tmp_path / "src")
    with start_registry(tmp_path / "reg", auth=True) as reg:
        assert reg.credentials is not None
        ref = f"oci://{reg.host}/models/tiny:v1"
        asyncio.run(push(model, ref, settings=settings(reg)))
        resolved = pull(ref, Cache(tmp_path / "cache"), settings(reg))
        assert resolved.model_path.read_bytes() == model.read_bytes()
        resolved.release()
        with pytest.raises(DeliveryError) as anonymous:
            pull(ref, Cache(tmp_path / "anon"), settings(reg, anonymous=True))
        assert anonymous.value.reason == "unauthorized"
        assert "none are configured" in str(anonymous.value)
        wrong = tmp_path / "wrong.json"
        wrong.write_text(
            json.dumps(
                {"auths": {reg.host: {"username": reg.credentials.user, "password": "not-" + reg.credentials.password}}}
            )
        )
        with pytest.raises(DeliveryError) as refused:
            pull(ref, Cache(tmp_path / "wrong"), RegistrySettings(docker_config=wrong))
        assert refused.value.reason == "unauthorized" and "credentials refused" in str(refused.value)
        secrets = [
            reg.credentials.password,
            reg.credentials.basic().removeprefix("Basic "),
            base64.b64encode(f"{reg.credentials.user}:not-{reg.credentials.password}".encode()).decode(),
        ]
        for text in (
            caplog.text,
            str(anonymous.value),
            str(refused.value),
            repr(refused.value),
            *(p.read_text(errors="replace") for p in (tmp_path / "cache").rglob("*.json")),
        ):
            for secret in secrets:
                assert secret not in text


def test_the_bearer_token_flow_against_the_registrys_token_auth(tmp_path: Path) -> None:
    model = weights(tmp_path / "src")
    with start_registry(tmp_path / "reg", token_auth=True) as reg:
        assert reg.tokens is not None
        ref = f"oci://{reg.host}/models/tiny:v1"
        asyncio.run(push(model, ref, settings=settings(reg)))
        before = len(reg.tokens.requests)
        resolved = pull(ref, Cache(tmp_path / "cache"), settings(reg))
        assert resolved.model_path.read_bytes() == model.read_bytes()
        resolved.release()
        asked = reg.tokens.requests[before:]
        # One token for the repository's pull scope serves the manifest, config and blob requests.
        assert [(r.scope, r.who) for r in asked] == [("repository:models/tiny:pull", "basic:wakegate")]
        with pytest.raises(DeliveryError) as anonymous:
            pull(ref, Cache(tmp_path / "anon"), settings(reg, anonymous=True))
        assert anonymous.value.reason == "unauthorized"
        assert reg.tokens.requests[-1].who == "anonymous"


def test_tls_with_a_custom_ca_and_a_clear_error_without_it(tmp_path: Path) -> None:
    model = weights(tmp_path / "src")
    with start_registry(tmp_path / "reg", tls=True) as reg:
        assert reg.ca is not None
        ref = f"oci://{reg.host}/models/tiny:v1"
        asyncio.run(push(model, ref, settings=settings(reg, ca_file=reg.ca)))
        resolved = pull(ref, Cache(tmp_path / "cache"), settings(reg, ca_file=reg.ca))
        assert resolved.model_path.read_bytes() == model.read_bytes()
        resolved.release()
        with pytest.raises(DeliveryError) as err:
            pull(ref, Cache(tmp_path / "untrusted"), settings(reg))
        assert err.value.reason == "unreachable" and "not trusted" in str(err.value)
        assert "--registry-ca-file" in str(err.value)


def test_a_pinned_digest_is_served_from_the_cache_with_the_registry_gone(tmp_path: Path) -> None:
    cache = Cache(tmp_path / "cache")
    first, second = weights(tmp_path / "v1"), weights(tmp_path / "v2")
    with start_registry(tmp_path / "reg") as reg:
        ref = f"oci://{reg.host}/models/tiny:v1"
        old = asyncio.run(push(first, ref, settings=settings(reg)))
        new = asyncio.run(push(second, ref, settings=settings(reg)))  # the tag moves
        pinned = f"oci://{reg.host}/models/tiny@{old}"
        resolved = pull(pinned, cache, settings(reg))
        assert resolved.record is not None and resolved.record.key == old
        assert resolved.model_path.read_bytes() == first.read_bytes()
        resolved.release()
        by_tag = pull(ref, cache, settings(reg))
        assert by_tag.record is not None and by_tag.record.key == new
        by_tag.release()
        with pytest.raises(DeliveryError) as err:
            pull(f"oci://{reg.host}/models/tiny@sha256:{'0' * 64}", cache, settings(reg))
        assert err.value.reason == "not_found"
    # Registry stopped: the pinned digest, and the tag under IF_NOT_PRESENT, need no request.
    assert pull(pinned, cache, settings(reg)).model_path.read_bytes() == first.read_bytes()
    assert pull(ref, cache, settings(reg)).model_path.read_bytes() == second.read_bytes()
    with pytest.raises(DeliveryError) as down:
        pull(ref, cache, settings(reg), policy=Policy.ALWAYS)
    assert down.value.reason == "unreachable"


def test_an_index_is_pulled_as_the_manifest_for_this_platform(tmp_path: Path) -> None:
    amd, arm = weights(tmp_path / "amd"), weights(tmp_path / "arm")
    with start_registry(tmp_path / "reg") as reg:
        digests = {}
        for name, path in (("amd64", amd), ("arm64", arm)):
            digests[name] = asyncio.run(push(path, f"oci://{reg.host}/models/multi:{name}", settings=settings(reg)))

        def entry(arch: str) -> dict[str, object]:
            size = len(
                reg.request("GET", f"/v2/models/multi/manifests/{arch}", headers={"Accept": media.OCI_MANIFEST}).body
            )
            return {
                "mediaType": media.OCI_MANIFEST,
                "digest": digests[arch],
                "size": size,
                "platform": {"os": "linux", "architecture": arch},
            }

        index = media.canonical_json(
            {"schemaVersion": 2, "mediaType": media.OCI_INDEX, "manifests": [entry("arm64"), entry("amd64")]}
        )

        async def put_index() -> None:
            async with RegistryClient(reg.host, settings(reg)) as client:
                await client.push_manifest("models/multi", "v1", index, media.OCI_INDEX)

        asyncio.run(put_index())
        cache = Cache(tmp_path / "cache")
        resolved = pull(f"oci://{reg.host}/models/multi:v1", cache, settings(reg))
        assert resolved.record is not None and resolved.record.key == digests["amd64"]
        assert resolved.model_path.read_bytes() == amd.read_bytes()
        resolved.release()
        # The index's own digest names the same entry (a recorded reference, no second pull).
        by_index = pull(f"oci://{reg.host}/models/multi@{digest_of(index)}", cache, settings(reg))
        assert by_index.record == resolved.record
        by_index.release()


def test_a_tar_layer_that_escapes_its_directory_is_refused(tmp_path: Path) -> None:
    evil = tmp_path / "evil.tar"
    payload = weights(tmp_path / "p", 10, "x")
    with tarfile.open(evil, "w") as tar:
        tar.add(payload, arcname="../../outside")
    with start_registry(tmp_path / "reg") as reg:
        out = reg.oras(
            "push", f"{reg.host}/models/evil:v1", "evil.tar:application/vnd.oci.image.layer.v1.tar", cwd=tmp_path
        )
        assert out.returncode == 0, out.stderr
        with pytest.raises(DeliveryError) as err:
            pull(f"oci://{reg.host}/models/evil:v1", Cache(tmp_path / "cache"), settings(reg))
        assert err.value.reason == "bad_artifact" and "leave the model" in str(err.value)
    assert not (tmp_path / "outside").exists()
    assert Cache(tmp_path / "cache").keys() == []


def test_a_registry_that_is_down_fails_at_once_with_a_clear_error(tmp_path: Path) -> None:
    port = free_port()
    events: list[Progress] = []

    async def attempt() -> None:
        await asyncio.wait_for(
            resolve(f"oci://127.0.0.1:{port}/models/tiny:v1", Cache(tmp_path / "cache"), progress=events.append),
            timeout=30,
        )

    with pytest.raises(DeliveryError) as err:
        asyncio.run(attempt())
    assert err.value.reason == "unreachable"
    assert f"registry 127.0.0.1:{port} is unreachable" in str(err.value)
    assert events[-1].phase is Phase.FAILED and "unreachable" in events[-1].detail


class _CuttingProxy:
    """A TCP proxy in front of the registry that breaks the first response to a blob GET after
    `cut` bytes, and records every request line and Range header it forwards."""

    def __init__(self, upstream: str, blob: str, cut: int) -> None:
        self.upstream = upstream
        self.blob = blob
        self.cut = cut
        self.requests: list[str] = []
        self.port = 0
        self._cut_done = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def serve(self) -> asyncio.AbstractServer:
        server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        return server

    async def close(self, server: asyncio.AbstractServer) -> None:
        server.close()
        for writer in self._writers:
            writer.transport.abort()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await server.wait_closed()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        host, port = self.upstream.rsplit(":", 1)
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        self._writers |= {writer, up_writer}
        budget: list[int | None] = [None]

        async def to_upstream() -> None:
            while data := await reader.read(65536):
                text = data.decode("latin-1")
                for line in text.split("\r\n"):
                    if line.startswith(("GET ", "HEAD ", "PUT ", "POST ")) or line.lower().startswith("range:"):
                        self.requests.append(line)
                if f"GET /v2/models/tiny/blobs/{self.blob}" in text and not self._cut_done:
                    self._cut_done = True
                    budget[0] = self.cut
                up_writer.write(data)
                await up_writer.drain()

        async def to_client() -> None:
            while data := await up_reader.read(65536):
                if budget[0] is not None:
                    if len(data) >= budget[0]:
                        writer.write(data[: budget[0]])
                        await writer.drain()
                        writer.transport.abort()
                        up_writer.transport.abort()
                        return
                    budget[0] -= len(data)
                writer.write(data)
                await writer.drain()

        try:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                await asyncio.gather(to_upstream(), to_client())
        finally:
            for end in (writer, up_writer):
                end.transport.abort()


def test_a_transfer_that_breaks_off_resumes_with_a_range_request(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = weights(tmp_path / "src", 12 * 1024 * 1024)
    with start_registry(tmp_path / "reg") as reg:
        asyncio.run(push(model, f"oci://{reg.host}/models/tiny:v1", settings=settings(reg)))
        layer = digest_of(model.read_bytes())

        async def pull_through_proxy() -> tuple[Resolved, _CuttingProxy]:
            proxy = _CuttingProxy(reg.host, layer, cut=5 * 1024 * 1024)
            server = await proxy.serve()
            try:
                resolved = await resolve(
                    f"oci://127.0.0.1:{proxy.port}/models/tiny:v1",
                    Cache(tmp_path / "cache"),
                    access=Access(registry=settings(reg)),
                )
            finally:
                await proxy.close(server)
            return resolved, proxy

        with caplog.at_level(logging.WARNING, "wakegate.delivery"):
            resolved, proxy = asyncio.run(pull_through_proxy())
        assert resolved.model_path.read_bytes() == model.read_bytes()
        resolved.release()
        blob_requests = [r for r in proxy.requests if layer in r or r.lower().startswith("range:")]
        assert blob_requests[0] == f"GET /v2/models/tiny/blobs/{layer} HTTP/1.1"
        assert blob_requests[1] == f"GET /v2/models/tiny/blobs/{layer} HTTP/1.1"
        assert blob_requests[2].lower().startswith("range: bytes=") and blob_requests[2].endswith("-")
        resumed_at = int(blob_requests[2].split("=")[1].rstrip("-"))
        assert 0 < resumed_at <= 5 * 1024 * 1024
        assert "broke off" in caplog.text and "resuming" in caplog.text
