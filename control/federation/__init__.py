"""Federation: one global gateway over several member clusters (docs/federation.md)."""
