"""A Model's `oci://…:TAG` source pinned to the digest the tag named when the operator first asked.

A tag can move; a Deployment whose pods name the tag would load whatever it names when each pod
starts, so two replicas of one Model could serve different weights. The operator resolves a
tag to a digest once (of the manifest, or index, the tag names then), records `spec.source`
with that digest in the Model's `status.pinnedSource`, and renders from the pinned source
(`pinned_body`): image volumes and the ModelCache it keeps name `…:TAG@sha256:…`. The record
holds while `spec.source` stays the same text (`recorded`); a new `spec.source` is resolved
anew. A source already naming a digest, and every other scheme, is used as written.

Pure: the operator's controller asks the registry (`Reconciler._pin`); this module decides what
a recorded pin is worth and what the pods are rendered from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from wakegate.control.delivery.errors import SourceError
from wakegate.control.delivery.sources import OciSource, parse_source

#: Model status field: `spec.source` with the digest its tag named when first resolved.
STATUS_FIELD = "pinnedSource"


def tag_source(source: object) -> OciSource | None:
    """The parsed source when it is an `oci://` tag without a digest (what needs pinning)."""
    if not isinstance(source, str) or not source.startswith("oci://"):
        return None
    try:
        parsed = parse_source(source)
    except SourceError:
        return None
    return parsed if isinstance(parsed, OciSource) and not parsed.pinned else None


def recorded(source: str, status: Mapping[str, Any] | None) -> str | None:
    """The pinned source in `status` when it pins exactly `source` (else None: resolve again)."""
    pinned = (status or {}).get(STATUS_FIELD)
    if tag_source(source) is None or not isinstance(pinned, str) or tag_of(pinned) != source:
        return None
    return pinned


def pinned_body(body: Mapping[str, Any], pinned: str) -> dict[str, Any]:
    """A copy of the Model object whose `spec.source` is `pinned` (what the pods are rendered from)."""
    return {**body, "spec": {**(body.get("spec") or {}), "source": pinned}}


def tag_of(pinned: str) -> str | None:
    """`oci://R/REPO:TAG` of a source naming both a tag and a digest; None for any other."""
    try:
        parsed = parse_source(pinned)
    except SourceError:
        return None
    if not isinstance(parsed, OciSource) or not parsed.pinned or parsed.tag is None:
        return None
    return str(replace(parsed, digest=None))


def same_weights(entry_source: str, entry_digest: object, pinned: str) -> bool:
    """Whether a node-cache entry pulled for `entry_source` holds the weights `pinned` names: the
    pinned source itself, or its tag when the entry has the pinned digest (a ModelCache of a
    person's naming the tag)."""
    if entry_source == pinned:
        return True
    tag = tag_of(pinned)
    return tag is not None and entry_source == tag and entry_digest == pinned.rpartition("@")[2]
