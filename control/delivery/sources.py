"""What a model's `source` names: `file://`, `oci://`, `hf://` and `pvc://`, parsed and checked.

Pure: a string in, a typed value (or one `SourceError` naming what is wrong) out. Every other
part of delivery takes these values, never the string, so a source is checked once.

- `file://PATH`: weights already on this machine, used in place (absolute, or relative to the
  directory the caller names).
- `oci://REGISTRY/REPOSITORY:TAG`, `oci://REGISTRY/REPOSITORY@sha256:HEX` (or both; the digest
  wins): an OCI artifact. The registry is always explicit (a host with a dot or a port, or
  `localhost`): there is no default registry for model weights.
- `hf://ORG/REPO[@REVISION][/PATH]`: a Hugging Face Hub repository at a branch, tag or commit
  (default `main`), optionally only the files matching PATH (a file name or a glob). A revision
  cannot contain `/`.
- `pvc://CLAIM[/PATH]`: a PersistentVolumeClaim on a cluster, mounted read-only by the pod.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

from wakegate.control.delivery.errors import SourceError

#: the digest algorithms OCI registries use, with their hex lengths
DIGEST_ALGORITHMS = {"sha256": 64, "sha512": 128}

_DIGEST = re.compile(r"^(sha256:[0-9a-f]{64}|sha512:[0-9a-f]{128})$")
_HOST_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = re.compile(rf"^(?:{_HOST_PART}(?:\.{_HOST_PART})*|\[[0-9a-fA-F:.]+\])(?::[0-9]{{1,5}})?$")
_PATH_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG = re.compile(r"^[\w][\w.-]{0,127}$")
_HF_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_HF_REVISION = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_CLAIM = re.compile(r"^[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*$")
#: the longest repository name (host and path) distribution accepts
MAX_OCI_NAME = 255
SCHEMES = ("file", "oci", "hf", "pvc")


@dataclass(frozen=True)
class FileSource:
    path: str
    """As written: absolute, or relative to a directory the caller chooses."""

    def __str__(self) -> str:
        return f"file://{self.path}"


@dataclass(frozen=True)
class OciSource:
    registry: str
    """HOST[:PORT]"""
    repository: str
    tag: str | None
    digest: str | None
    """`sha256:HEX`; when set, the artifact is pinned and the tag is only a label."""

    @property
    def pinned(self) -> bool:
        return self.digest is not None

    @property
    def reference(self) -> str:
        """What a manifest is fetched by: the digest when pinned, else the tag."""
        return self.digest or self.tag or ""

    def at(self, digest: str) -> OciSource:
        """The same artifact pinned to `digest`."""
        return OciSource(self.registry, self.repository, self.tag, digest)

    def __str__(self) -> str:
        tag = f":{self.tag}" if self.tag else ""
        digest = f"@{self.digest}" if self.digest else ""
        return f"oci://{self.registry}/{self.repository}{tag}{digest}"


@dataclass(frozen=True)
class HfSource:
    repo: str
    """ORG/REPO"""
    revision: str
    """A branch, tag or commit; `main` when the source names none."""
    path: str | None
    """Only the files matching this name or glob; the whole repository when None."""

    def __str__(self) -> str:
        path = f"/{self.path}" if self.path else ""
        return f"hf://{self.repo}@{self.revision}{path}"


@dataclass(frozen=True)
class PvcSource:
    claim: str
    path: str
    """Inside the claim; empty for its root."""

    def __str__(self) -> str:
        return f"pvc://{self.claim}/{self.path}" if self.path else f"pvc://{self.claim}"


Source = FileSource | OciSource | HfSource | PvcSource


def parse_source(text: str) -> Source:
    """The typed source that `text` names; `SourceError` says what is wrong with it."""
    if not isinstance(text, str) or not text.strip():
        raise SourceError("a source is a non-empty string such as oci://REGISTRY/REPO:TAG")
    if any(ch.isspace() for ch in text):
        raise SourceError(f"source {text!r} contains white space")
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in SCHEMES:
        raise SourceError(f"source {text!r} must start with one of {', '.join(s + '://' for s in SCHEMES)}")
    if not rest:
        raise SourceError(f"source {text!r} names nothing after {scheme}://")
    if scheme == "file":
        return FileSource(rest)
    if scheme == "oci":
        return parse_oci(rest)
    if scheme == "hf":
        return _parse_hf(rest)
    return _parse_pvc(rest)


def parse_digest(text: str) -> str:
    """`text` if it is an `ALGORITHM:HEX` digest this code can verify, else `SourceError`."""
    if not _DIGEST.match(text):
        raise SourceError(f"{text!r} is not a digest (sha256:<64 hex> or sha512:<128 hex>, lower case)")
    return text


def parse_oci(text: str) -> OciSource:
    """`REGISTRY/REPOSITORY[:TAG][@DIGEST]`, the part after `oci://`."""
    name, at, digest = text.partition("@")
    if at:
        parse_digest(digest)
    registry, slash, path = name.partition("/")
    if not slash or not path:
        raise SourceError(f"oci://{text}: name a registry and a repository (oci://REGISTRY/REPO:TAG)")
    if not _HOST.match(registry) or not ("." in registry or ":" in registry or registry == "localhost"):
        raise SourceError(
            f"oci://{text}: {registry!r} is not a registry host (it needs a dot or a port, or is localhost)"
        )
    tag: str | None = None
    last = path.rsplit("/", 1)[-1]
    if ":" in last:
        path, _, tag = path.rpartition(":")
        if not _TAG.match(tag):
            raise SourceError(f"oci://{text}: {tag!r} is not a tag (letters, digits, _ . -, at most 128)")
    for component in path.split("/"):
        if not _PATH_COMPONENT.match(component):
            raise SourceError(
                f"oci://{text}: repository component {component!r} must be lower-case letters and digits "
                "separated by . _ __ or -"
            )
    if len(registry) + 1 + len(path) > MAX_OCI_NAME:
        raise SourceError(f"oci://{text}: the repository name is longer than {MAX_OCI_NAME} characters")
    if tag is None and not at:
        raise SourceError(f"oci://{text}: name a tag (:v1) or a digest (@sha256:…)")
    return OciSource(registry, path, tag, digest if at else None)


def _relative_path(text: str, what: str, where: str) -> str:
    """A relative POSIX path without `.`/`..`/empty components (nothing above its root)."""
    parts = text.split("/")
    if text.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise SourceError(f"{where}: {what} {text!r} must be a relative path without '.', '..' or '//'")
    return text


def _parse_hf(text: str) -> HfSource:
    where = f"hf://{text}"
    parts = text.split("/", 2)
    if len(parts) < 2:
        raise SourceError(f"{where}: name an organisation and a repository (hf://ORG/REPO[@REVISION])")
    org, repo_rev = parts[0], parts[1]
    repo, at, revision = repo_rev.partition("@")
    for name in (org, repo):
        if not _HF_NAME.match(name) or ".." in name or name.endswith((".", "-")):
            raise SourceError(f"{where}: {name!r} is not a Hub name (letters, digits, . _ -, at most 96)")
    if at and not _HF_REVISION.match(revision):
        raise SourceError(f"{where}: {revision!r} is not a revision (a branch, tag or commit without '/')")
    path = _relative_path(parts[2], "path", where) if len(parts) == 3 else None
    return HfSource(f"{org}/{repo}", revision if at else "main", path)


def _parse_pvc(text: str) -> PvcSource:
    where = f"pvc://{text}"
    claim, _, path = text.partition("/")
    if len(claim) > 253 or not _CLAIM.match(claim):
        raise SourceError(f"{where}: {claim!r} is not a claim name (a DNS-1123 subdomain)")
    path = path.rstrip("/")
    return PvcSource(claim, _relative_path(path, "path", where) if path else "")


def safe_relative(path: str) -> PurePosixPath:
    """A file name from an artifact (an annotation, a tar member) as a path below the entry's
    root, or `SourceError`: absolute paths, `..` and empty components would escape it."""
    if not path or "\x00" in path:
        raise SourceError(f"file name {path!r} is empty or has a NUL byte")
    pure = PurePosixPath(path)
    if pure.is_absolute() or any(part in ("..", "") for part in path.split("/")) or pure == PurePosixPath("."):
        raise SourceError(f"file name {path!r} would leave the model's directory")
    return PurePosixPath(*[p for p in pure.parts if p != "."])
