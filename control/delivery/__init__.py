"""Model delivery: weights from a source into a verified local cache, and from there into fast storage.

The public face (what `wakegate up`, the backends and the node agent call):

- :func:`resolve` (`resolver.py`): a source string to a local path, pulled into the cache and
  leased while an engine uses it, with :class:`Progress` events on the way;
- :func:`stage` (`flashload.py`): a resolved model copied into fast storage (tmpfs) or the page
  cache with parallel aligned reads, verified block by block;
- :func:`push` (`pushing.py`): a file or directory published as a ModelPack OCI artifact;
- :class:`Cache` (`cache.py`): the content-addressed cache directory, its leases and eviction.

Pure modules (no I/O): `sources` (what a source names), `media` (manifests and media types),
`digests` (digest and block table), `index` (readiness marker, eviction decisions),
`credentials` (Docker config and auth challenges), `progress`, `errors`. The delivery code knows
nothing of engines or Kubernetes.
"""
