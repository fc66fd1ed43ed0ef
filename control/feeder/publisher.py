"""Pushing what is routable into the snapshot cache: coalesced, gated by what clients acknowledged.

Both feeders (`wakegate up`'s, from its local runtime, and `wakegate xds`, from Kubernetes
watches) call `publish_soon()` on every change of their source; a burst of changes becomes
one snapshot, built on the next loop turn from the source's current `RoutedModel`s. Once the
ADS server runs, each build also makes one view per gateway (node id) from that gateway's
own record of which endpoints its Envoy confirmed and its extproc may still hold
(docs/decisions.md, "Endpoint changes reach extproc only after its own Envoy acknowledged
them").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from wakegate.control.feeder.ads import AdsServer
from wakegate.control.feeder.cache import SnapshotCache
from wakegate.control.feeder.resources import BuildMemo, Resources, build, for_gateway
from wakegate.control.feeder.routed import RoutedModel
from wakegate.control.feeder.settings import GatewayKey, GatewaySettings


class Publisher:
    def __init__(self, cache: SnapshotCache, gateway: GatewaySettings, routed: Callable[[], list[RoutedModel]]) -> None:
        self.cache = cache
        self.gateway = gateway
        self._routed = routed
        #: Set once the ADS server runs; its acknowledgements gate the snapshots from then on.
        self.ads: AdsServer | None = None
        self._pending = False
        #: The API keys native routes check (`GatewaySettings.key_checks`); set as the key file changes.
        self.keys: tuple[GatewayKey, ...] = ()
        #: The last build's messages: a change rebuilds only what it touched.
        self.memo = BuildMemo()
        #: The models, keys and base snapshot of the last build.
        self._last: tuple[tuple[RoutedModel, ...], tuple[GatewayKey, ...], Resources] | None = None

    def publish_soon(self) -> None:
        """Coalesce bursts of changes into one snapshot, pushed on the next loop turn."""
        if not self._pending:
            self._pending = True
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self.publish()))

    async def publish(self) -> None:
        self._pending = False
        routed = self._routed()
        last = self._last
        if (
            last is not None
            and last[1] is self.keys
            and len(last[0]) == len(routed)
            and all(a is b for a, b in zip(last[0], routed, strict=True))
        ):
            base = last[2]  # only acknowledgements moved: the same models give the same base
        else:
            base = build(routed, self.gateway, keys=self.keys, memo=self.memo)
            self._last = (tuple(routed), self.keys, base)
        views = {}
        if self.ads is not None:
            views = {
                node: for_gateway(
                    base,
                    routed,
                    self._confirmed(node),
                    self.ads.retained(node),
                    self.gateway,
                    self.ads.routed_natively(node),
                    self.keys,
                )
                for node in self.ads.gateways()
            }
        await self.cache.set(self._for_unknown(routed, base), views)

    def _confirmed(self, node: str) -> Mapping[str, frozenset[tuple[str, int]]] | None:
        """What gates `node`'s endpoints: what its own Envoy acknowledged."""
        return self.ads.confirmed(node) if self.ads is not None else None

    def _for_unknown(self, routed: list[RoutedModel], base: Resources) -> Resources:
        """The snapshot of a gateway with no view of its own yet."""
        return base
