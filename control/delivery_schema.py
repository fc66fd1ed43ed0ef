"""The typed kinds of model delivery on a cluster (wakegate.io/v1alpha1): `ModelCache` (weights
kept in the nodes' caches) and `ModelCatalog` (what a registry publishes); their CRDs are
generated from them (control/crd.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from wakegate.control.schema import NAME_PATTERN, SOURCE_PATTERN, Metadata, SecretRef, Spec

# -- ModelCache (namespaced, Kubernetes only) ------------------------------------------------------

#: The schemes a node cache holds; file:// and pvc:// are read in place and never cached.
CACHED_SCHEMES = ("oci", "hf")


class ModelRef(Spec):
    name: str = Field(pattern=NAME_PATTERN, max_length=60, description="A Model in the same namespace.")


class ModelCacheSpec(Spec):
    sources: list[Annotated[str, Field(pattern=SOURCE_PATTERN, max_length=2048)]] = Field(
        min_length=1,
        max_length=16,
        description="Weights to keep in the node caches: oci://REGISTRY/REPO:TAG or @sha256:…, or hf://…",
    )
    nodeSelector: dict[str, str] = Field(
        default_factory=dict, description="Only nodes with all of these labels; with modelRef, both apply."
    )
    modelRef: ModelRef | None = Field(
        None, description="Every node the Model may run on (its node selector and GPU vendor and arch)."
    )
    credentials: SecretRef | None = Field(None, description="Registry credentials; never logged or shown.")

    @field_validator("sources")
    @classmethod
    def _cached_sources(cls, values: list[str]) -> list[str]:
        from wakegate.control.delivery.errors import SourceError
        from wakegate.control.delivery.sources import parse_source

        for value in values:
            try:
                parse_source(value)
            except SourceError as exc:
                raise ValueError(str(exc)) from None
            if value.partition("://")[0] not in CACHED_SCHEMES:
                raise ValueError(f"{value}: a node cache holds oci:// and hf:// sources (the others are read in place)")
        if len(set(values)) != len(values):
            raise ValueError("sources lists a source twice")
        return values


class ModelCache(Spec):
    apiVersion: Literal["wakegate.io/v1alpha1"] = "wakegate.io/v1alpha1"
    kind: Literal["ModelCache"] = "ModelCache"
    metadata: Metadata
    spec: ModelCacheSpec


# -- ModelCatalog (namespaced, Kubernetes only; `wakegate catalog` on one machine) ------------------

#: A registry host, optionally with a port: what `oci://HOST[:PORT]/…` names.
REGISTRY_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?(:[0-9]{1,5})?$"
#: A repository prefix: path segments of an OCI repository name.
REPOSITORY_PREFIX_PATTERN = r"^[a-z0-9]+([._-][a-z0-9]+)*(/[a-z0-9]+([._-][a-z0-9]+)*)*$"


class ModelCatalogSpec(Spec):
    registry: str = Field(pattern=REGISTRY_PATTERN, max_length=255, description="The registry host[:port].")
    repositories: list[Annotated[str, Field(pattern=REPOSITORY_PREFIX_PATTERN, max_length=255)]] = Field(
        default_factory=list,
        max_length=64,
        description="Repository prefixes to list (a whole path segment: `models` holds `models/llama`); "
        "empty: every repository. A registry that does not list its catalog is read at these names.",
    )
    credentials: SecretRef | None = Field(
        None, description="A `kubernetes.io/dockerconfigjson` Secret with the registry's credentials; never shown."
    )
    refreshSeconds: int = Field(
        300, ge=30, le=86400, description="How often the registry is listed again. Changing the "
        "`wakegate.io/refresh` annotation lists it at once."
    )
    plainHTTP: bool = Field(False, description="Speak plain HTTP to the registry (a trusted network only).")


class ModelCatalog(Spec):
    apiVersion: Literal["wakegate.io/v1alpha1"] = "wakegate.io/v1alpha1"
    kind: Literal["ModelCatalog"] = "ModelCatalog"
    metadata: Metadata
    spec: ModelCatalogSpec
