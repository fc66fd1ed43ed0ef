"""Pure snapshot builder: routable models in, Envoy and extproc xDS resources out.

No I/O. The same builder serves the local runtime (`wakegate up`) and the
Kubernetes watch (`wakegate xds`): both describe what is routable as
`RoutedModel` values (routed.py) and get back typed resources keyed by type URL and name, each
made by its own module (listeners.py, routes.py, clusters.py, model_routes.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from typing import Any

from google.protobuf.message import Message

from wakegate import contract
from wakegate.control.feeder.clusters import load_assignment, model_cluster
from wakegate.control.feeder.envoy_types import (
    CLUSTER,
    ENDPOINT,
    LISTENER,
    LISTENER_NAME,
    MODEL_ROUTE,
    ROUTE,
    ROUTE_NAME,
    WILDCARD_TYPES,
    M,
)
from wakegate.control.feeder.listeners import listener, replay_listener
from wakegate.control.feeder.model_routes import model_route
from wakegate.control.feeder.native import may_go_native, native_keys
from wakegate.control.feeder.ratelimit import envoy_rate_limited
from wakegate.control.feeder.routed import RoutedModel
from wakegate.control.feeder.routes import route_configuration
from wakegate.control.feeder.settings import GatewayKey, GatewaySettings


@dataclass(frozen=True)
class Resources:
    """One consistent set of resources: type URL -> name -> message."""

    by_type: Mapping[str, Mapping[str, Message]]
    #: Keys of the models Envoy routes alone in this (base) snapshot: `native_keys` without gating.
    native: frozenset[str] = frozenset()

    def select(self, type_url: str, names: Iterable[str]) -> dict[str, Message]:
        available = self.by_type.get(type_url, {})
        wanted = set(names)
        if type_url in WILDCARD_TYPES or not wanted:
            return dict(available)
        return {n: m for n, m in available.items() if n in wanted}


def version_of(resources: Mapping[str, Message]) -> str:
    """Content hash: equal resource sets have equal versions, so nothing is re-sent needlessly.

    Built from each resource's own digest (`resource_digest`), which is computed once per message
    object: a thousand unchanged resources cost a thousand dictionary lookups, not serialisations.
    """
    digest = hashlib.blake2b(digest_size=12)
    for name in sorted(resources):
        digest.update(name.encode())
        digest.update(b"\0")
        digest.update(resource_digest(resources[name]))
    return digest.hexdigest()


#: id(message) -> (message, digest). The message is kept alive by the entry, so its id cannot be
#: taken by another object while the entry stands; resources are never changed once built.
_DIGESTS: dict[int, tuple[Message, bytes]] = {}
#: Entries the memo may hold beyond twice what the current snapshot and views use.
DIGEST_MEMO_SLACK = 64


def keep_digests_of(snapshots: Iterable[Resources]) -> None:
    """A new snapshot (and its views) was set: once the memo holds more than twice what they use,
    the entries of messages none of them uses go, and the messages with them. Keeping every
    message ever built grew a feeder by about a megabyte a minute while models woke and idled
    (tests/bench/bench_soak.py). The pass over the live messages runs only after the memo grew
    by at least their number, so it costs O(1) per message built."""
    snapshots = list(snapshots)
    live = sum(len(messages) for resources in snapshots for messages in resources.by_type.values())
    if len(_DIGESTS) <= 2 * live + DIGEST_MEMO_SLACK:
        return
    used = {id(m) for resources in snapshots for messages in resources.by_type.values() for m in messages.values()}
    for key in [k for k in _DIGESTS if k not in used]:
        del _DIGESTS[key]


def resource_digest(message: Message) -> bytes:
    """A digest of one resource's content, memoised per message object (built messages never change)."""
    found = _DIGESTS.get(id(message))
    if found is not None and found[0] is message:
        return found[1]
    value = hashlib.blake2b(message.SerializeToString(deterministic=True), digest_size=12).digest()
    _DIGESTS[id(message)] = (message, value)
    return value


class BuildMemo:
    """What the last `build` made, reused by the next one for whatever did not change.

    A change to one model rebuilds that model's cluster, endpoints and route and nothing else;
    the listener and the route table are rebuilt only when their own inputs change. A model
    counts as unchanged when it is the same object as last time (the feeders keep unchanged
    models as they are) or equal to it.
    """

    def __init__(self) -> None:
        #: model key -> (model, settings, counted by Envoy, cluster, load assignment, route)
        self.models: dict[str, tuple[RoutedModel, GatewaySettings, bool, Message, Message, Message]] = {}
        self.listener: tuple[tuple[Any, ...], Message] | None = None
        self.replay: tuple[tuple[Any, ...], Message] | None = None
        self.routes: tuple[tuple[Any, ...], Message] | None = None
        #: Per-model messages built (not reused) by the last build: what a change cost.
        self.rebuilt = 0
        self._last: dict[str, Mapping[str, Message]] = {}

    def model(self, m: RoutedModel, settings: GatewaySettings, counted: bool) -> tuple[Message, Message, Message]:
        found = self.models.get(m.key)
        if (
            found is not None
            and (found[0] is m or found[0] == m)
            and (found[1] is settings or found[1] == settings)
            and found[2] == counted
        ):
            return found[3], found[4], found[5]
        self.rebuilt += 1
        made = (model_cluster(m, settings), load_assignment(m), model_route(m, counted, settings.global_rps > 0))
        self.models[m.key] = (m, settings, counted, *made)
        return made

    def same(self, kind: str, made: dict[str, Message]) -> Mapping[str, Message]:
        """`made`, or the equal mapping of the last build (same names, same message objects)."""
        last = self._last.get(kind)
        if last is not None and len(last) == len(made) and all(last.get(n) is m for n, m in made.items()):
            return last
        self._last[kind] = made
        return made

    def keep_only(self, keys: AbstractSet[str]) -> None:
        for key in [k for k in self.models if k not in keys]:
            del self.models[key]


def _memoised(
    slot: tuple[tuple[Any, ...], Message] | None, inputs: tuple[Any, ...], make: Callable[[], M]
) -> tuple[tuple[tuple[Any, ...], Message], M]:
    if slot is not None and slot[0] == inputs:
        return slot, slot[1]  # type: ignore[return-value]
    made = make()
    return (inputs, made), made


def build(
    models: Sequence[RoutedModel],
    settings: GatewaySettings,
    confirmed: Mapping[str, frozenset[tuple[str, int]]] | None = None,
    retained: Mapping[str, frozenset[tuple[str, int]]] | None = None,
    routed_natively: AbstractSet[str] | None = None,
    keys: Sequence[GatewayKey] = (),
    memo: BuildMemo | None = None,
) -> Resources:
    """Every resource for one consistent view of the fleet, as one gateway should see it.

    Without `confirmed`, `retained` and `routed_natively` this is the base snapshot: every ready
    endpoint, ungated. With them it is `for_gateway(build(models, settings), ...)`. `keys`: the
    API keys native routes check (`GatewaySettings.key_checks`). `memo`: what the last build
    with the same memo made, reused where its inputs did not change (the feeders keep one).
    """
    memo = memo if memo is not None else BuildMemo()
    memo.rebuilt = 0
    native = native_keys(models, settings)
    body_metadata = may_go_native(models, settings)
    limited = envoy_rate_limited(models, settings)
    chosen = tuple(m for m in models if m.key in native)
    keys = tuple(keys)
    memo.routes, routes = _memoised(
        memo.routes,
        (settings, chosen, body_metadata, keys, limited),
        lambda: route_configuration(settings, chosen, body_metadata=body_metadata, keys=keys, rate_limited=limited),
    )
    memo.listener, the_listener = _memoised(
        memo.listener, (settings, body_metadata, limited), lambda: listener(settings, body_metadata, limited)
    )
    listeners: dict[str, Message] = {LISTENER_NAME: the_listener}
    if settings.replay:
        memo.replay, listeners[contract.REPLAY_LISTENER] = _memoised(
            memo.replay, (settings, body_metadata, limited), lambda: replay_listener(settings, body_metadata, limited)
        )
    counted = {m.key for m in limited}
    clusters: dict[str, Message] = {}
    endpoints: dict[str, Message] = {}
    model_routes: dict[str, Message] = {}
    for m in models:
        clusters[m.cluster], endpoints[m.cluster], model_routes[m.key] = memo.model(m, settings, m.key in counted)
    if len(memo.models) > len(models):
        memo.keep_only({m.key for m in models})
    base = Resources(
        by_type={
            LISTENER: listeners,
            ROUTE: {ROUTE_NAME: routes},
            # The same mapping as last time where nothing in it changed: a stream can tell at once.
            CLUSTER: memo.same("clusters", clusters),
            ENDPOINT: memo.same("endpoints", endpoints),
            MODEL_ROUTE: memo.same("routes", model_routes),
        },
        native=native,
    )
    if confirmed is None and retained is None and routed_natively is None:
        return base
    return for_gateway(base, models, confirmed, retained, settings, routed_natively, keys)


def for_gateway(
    base: Resources,
    models: Sequence[RoutedModel],
    confirmed: Mapping[str, frozenset[tuple[str, int]]] | None,
    retained: Mapping[str, frozenset[tuple[str, int]]] | None,
    settings: GatewaySettings | None = None,
    routed_natively: AbstractSet[str] | None = None,
    keys: Sequence[GatewayKey] = (),
) -> Resources:
    """One gateway's view of `base` (built from the same `models` and `keys`), gated by its own
    acknowledgements.

    `confirmed` (cluster -> endpoints this gateway's Envoy has acknowledged) gates what its
    extproc sees: a new endpoint reaches extproc's route only once Envoy can route to it, so
    a held request is never flushed to a cluster that does not know the host yet. Clusters
    missing from `confirmed`, or no `confirmed` at all, are not gated (no Envoy to wait for).
    It gates the native routes the same way (native_keys): a model turns native only once its
    Envoy has one of its endpoints.

    `retained` (cluster -> endpoints this gateway's extproc may still pick) keeps a removed
    endpoint in its Envoy's cluster until that extproc has dropped it, so the other
    direction has no gap either. The backend is still draining meanwhile.

    `routed_natively` (clusters this gateway's Envoy has acknowledged native routes to) does
    the same for Envoy's own routes: a cluster keeps the endpoints its Envoy has until that
    Envoy has dropped its native routes, so a model's last endpoint leaves only after its
    requests go to extproc again (which holds them).

    Only the messages that differ from the base are rebuilt; in the steady state (every
    acknowledgement current) the base itself is returned.
    """
    base_endpoints = base.by_type[ENDPOINT]
    base_routes = base.by_type[MODEL_ROUTE]
    endpoints: dict[str, Message] | None = None  # copied on the first change only
    routes: dict[str, Message] | None = None
    route_config = base.by_type[ROUTE]
    native_clusters = routed_natively or frozenset()
    no_retained: Mapping[str, frozenset[tuple[str, int]]] = {}
    retained = retained or no_retained
    empty: frozenset[tuple[str, int]] = frozenset()
    # Per model a few set operations in C: with a thousand models a view costs about a millisecond.
    for m in models:
        cluster = m.cluster
        ready = m.endpoint_set
        held = retained.get(cluster)
        kept = held - ready if held is not None and not held <= ready else empty
        if not ready and not kept and cluster in native_clusters:
            kept = (confirmed or {}).get(cluster, empty)
        if kept:
            if endpoints is None:
                endpoints = dict(base_endpoints)
            endpoints[cluster] = load_assignment(replace(m, endpoints=tuple(sorted(ready | kept))))
        if confirmed is not None and ready:
            have = confirmed.get(cluster)
            if have is not None and not ready <= have:
                if routes is None:
                    routes = dict(base_routes)
                allowed = tuple(e for e in m.endpoints if e in have)
                rate = base_routes[m.key].rate_limit  # type: ignore[attr-defined]
                routes[m.key] = model_route(
                    replace(m, endpoints=allowed), rate.counted_by_envoy, rate.global_counted_by_envoy
                )
    if settings is not None and base.native:
        native = frozenset(
            m.key
            for m in models
            if m.key in base.native
            and not (confirmed is not None and m.cluster in confirmed and not m.endpoint_set & confirmed[m.cluster])
        )
        if native != base.native:
            chosen = [m for m in models if m.key in native]
            route_config = {
                ROUTE_NAME: route_configuration(
                    settings,
                    chosen,
                    body_metadata=may_go_native(models, settings),
                    keys=keys,
                    rate_limited=envoy_rate_limited(models, settings),
                )
            }
    if endpoints is None and routes is None and route_config is base.by_type[ROUTE]:
        return base
    return Resources(
        by_type={
            **base.by_type,
            ENDPOINT: base_endpoints if endpoints is None else endpoints,
            MODEL_ROUTE: base_routes if routes is None else routes,
            ROUTE: route_config,
        },
        native=base.native,
    )
