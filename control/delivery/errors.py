"""The one error type of delivery, with a machine-readable reason for callers and status.

Pure. Every failure a caller can act on is a `DeliveryError` whose message names the source or
file and what went wrong, and never carries a credential; `reason` is a short stable word that
`wakegate up` and the operator put in status (`wakegate up` fails the activation of any of them
with the code `weights_unavailable`, and keeps the reason next to it).
"""

from __future__ import annotations


class DeliveryError(Exception):
    """A delivery step failed; `str()` is one line for a person, `reason` a word for a program."""

    reason = "failed"

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class SourceError(DeliveryError, ValueError):
    """A source string that cannot be used; the message says which part and why."""

    reason = "bad_source"


class ManifestError(DeliveryError, ValueError):
    """A manifest that cannot be turned into files; the message names the layer and why."""

    reason = "bad_artifact"


class DigestMismatch(DeliveryError, ValueError):
    """Bytes whose digest is not the one expected; the message names what and both digests."""

    reason = "digest_mismatch"


class MarkerError(DeliveryError, ValueError):
    """A readiness marker that cannot be read: its entry is not used."""

    reason = "bad_marker"


class RegistryError(DeliveryError):
    """An OCI registry refused or could not be reached (`unreachable`, `unauthorized`,
    `not_found`, `registry_error`)."""

    reason = "registry_error"


class HubError(DeliveryError):
    """The Hugging Face Hub refused or could not be reached."""

    reason = "hub_error"


class CacheFull(DeliveryError):
    """An entry does not fit in the cache's budget or on its file system, even after evicting
    every entry not in use."""

    reason = "cache_full"
