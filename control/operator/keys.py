"""The reconcile queue's keys: a Model's is its namespace/name, another kind's carries its prefix."""

from __future__ import annotations

#: Queue keys of ModelCaches (their summary status) carry this prefix; Model keys carry none.
CACHE_KEY = "ModelCache:"
#: Queue keys of ModelCatalogs (a listing of their registry) carry this prefix.
CATALOG_KEY = "ModelCatalog:"
#: Queue keys of LoRAAdapters (their status) carry this prefix.
ADAPTER_KEY = "LoRAAdapter:"
