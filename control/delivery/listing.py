"""List what a registry publishes: repositories (optionally under prefixes), their tags, and
for each tag its manifest (and ModelPack config), as `catalog.Entry`s.

Bounded everywhere: pages of `page` names, at most `max_repositories` repositories,
`max_tags` tags per repository and `max_entries` entries in all, `concurrency` requests at a
time. A registry that does not list its catalog (403/404, as Docker Hub and some hosted
registries do) is still listed when the prefixes name whole repositories: those are read
directly. A repository or tag that cannot be read is an error line, not a failure of the whole.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from wakegate.control.delivery import media
from wakegate.control.delivery.catalog import Entry, Refreshed, describe, matches
from wakegate.control.delivery.credentials import DockerAuths
from wakegate.control.delivery.errors import DeliveryError, RegistryError
from wakegate.control.delivery.registry import RegistryClient, RegistrySettings

#: the biggest config blob read for its facts
MAX_CONFIG = 256 * 1024


@dataclass(frozen=True)
class Limits:
    page: int = 100
    max_repositories: int = 10_000
    max_tags: int = 1_000
    max_entries: int = 5_000
    concurrency: int = 8


async def _entry(client: RegistryClient, repository: str, tag: str, gate: asyncio.Semaphore) -> Entry:
    async with gate:
        digest, parsed, body = await client.manifest(repository, tag)
        top_type = parsed.media_type
        if isinstance(parsed, media.Index):
            _, manifest, body = await client.model_manifest(repository, digest)
        else:
            manifest = parsed
        annotations = media.manifest_annotations(body)
        config = None
        if manifest.config.media_type == media.MODEL_CONFIG and manifest.config.size <= MAX_CONFIG:
            config = await client.blob_bytes(repository, manifest.config, MAX_CONFIG)
    return describe(repository, tag, digest, top_type, manifest, config, annotations)


async def _repositories(client: RegistryClient, prefixes: Sequence[str],
                        limits: Limits) -> tuple[list[str], RegistryError | None]:
    """The repositories to read, and the catalog's refusal when the prefixes stand in for it."""
    try:
        names = await client.repositories(limits.page, limits.max_repositories)
    except RegistryError as exc:
        if exc.reason in ("unauthorized", "not_found") and prefixes:
            return [p.strip("/") for p in prefixes], exc
        raise
    return sorted(n for n in names if matches(n, prefixes)), None


async def list_registry(registry: str, prefixes: Sequence[str] = (), settings: RegistrySettings | None = None,
                        auths: DockerAuths | None = None, limits: Limits = Limits()) -> Refreshed:
    """Every (repository, tag) of `registry` under `prefixes`; a registry that cannot be listed
    at all is a `failure`, never an exception."""
    gate = asyncio.Semaphore(limits.concurrency)
    errors: list[str] = []
    async with RegistryClient(registry, settings or RegistrySettings(), auths=auths) as client:
        try:
            repositories, refused = await _repositories(client, prefixes, limits)
        except DeliveryError as exc:
            return Refreshed((), (), (exc.reason, str(exc)))

        async def tags_of(repository: str) -> list[str]:
            async with gate:
                try:
                    return await client.tags(repository, limits.page, limits.max_tags)
                except DeliveryError as exc:
                    errors.append(f"{repository}: {exc}")
                    return []

        tagged = await asyncio.gather(*(tags_of(r) for r in repositories))
        if refused is not None and not any(tagged):
            # Not one prefix was a readable repository either: the registry refused us.
            return Refreshed((), (), (refused.reason, str(refused)))
        wanted = [(r, t) for r, tags in zip(repositories, tagged, strict=True) for t in sorted(tags)]
        if len(wanted) > limits.max_entries:
            errors.append(f"{len(wanted) - limits.max_entries} tags past the limit of {limits.max_entries} not read")
            wanted = wanted[:limits.max_entries]

        async def one(repository: str, tag: str) -> Entry | None:
            try:
                return await _entry(client, repository, tag, gate)
            except DeliveryError as exc:
                errors.append(f"{repository}:{tag}: {exc}")
                return None

        found = await asyncio.gather(*(one(r, t) for r, t in wanted))
    return Refreshed(tuple(e for e in found if e is not None), tuple(sorted(errors)))
