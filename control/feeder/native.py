"""The routing path of a model: whether Envoy routes it alone (native) or extproc decides, and why."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from wakegate.control.feeder.routed import RoutedModel
from wakegate.control.feeder.settings import GatewaySettings

#: Strategies Envoy's own load balancing does as extproc would (docs/decisions.md): round robin
#: exactly; least-loaded by a full scan of this Envoy's active requests per endpoint (what extproc
#: counts, less the engines' readings of other gateways' traffic).
NATIVE_STRATEGIES = frozenset({"round-robin", "least-loaded"})


def native_blocker(model: RoutedModel, settings: GatewaySettings) -> str:
    """Why `model` takes the decided path (extproc) now; empty when Envoy can route it alone.

    Static reasons first (what the spec or the gateway needs of extproc), then the moment's:
    a model with no ready endpoint is cold, and only extproc holds or wakes.
    """
    static = static_native_blocker(model, settings)
    if static:
        return static
    if not model.admitted:
        return "waiting for its GPU group"
    if not model.endpoints:
        return "no ready endpoint"
    return ""


def static_native_blocker(model: RoutedModel, settings: GatewaySettings) -> str:
    """What keeps `model` on the decided path whether it is warm or cold: its manifest or the
    gateway's settings need extproc. Empty: the model is native whenever it is warm."""
    if model.path != "native":
        return "routing.path is decided"
    if not settings.native_allowed:
        return "the gateway's native path is off (API keys or a global rate limit on the cluster)"
    if model.strategy not in NATIVE_STRATEGIES or model.profile or model.weights:
        return "scored or sticky picking (native takes strategy round-robin or least-loaded)"
    if model.adapters or model.lora_adapters:
        return "LoRA adapters"
    if settings.global_rate_limit or settings.global_rps > 0:
        return "a gateway-wide rate limit (--global-rps)"
    if model.flow is not None:
        return "flow control (requests are admitted by extproc)"
    return ""


def routing_path(model: RoutedModel, settings: GatewaySettings) -> dict[str, str]:
    """`routingPath` (native or decided) and, when decided, `routingPathReason` (native_blocker):
    what `wakegate up`'s /status and a Model's status on a cluster say of the model's path now."""
    blocker = native_blocker(model, settings)
    if not blocker:
        return {"routingPath": "native"}
    return {"routingPath": "decided", "routingPathReason": blocker}


def native_keys(
    models: Sequence[RoutedModel],
    settings: GatewaySettings,
    confirmed: Mapping[str, frozenset[tuple[str, int]]] | None = None,
) -> frozenset[str]:
    """Models Envoy routes alone in one gateway's view.

    With `confirmed` (what the gateway's Envoy acknowledged), a model goes native only once its
    Envoy has at least one of its ready endpoints: a native route never points at a cluster
    Envoy has no host in. Clusters missing from `confirmed` are not gated (no Envoy to wait for).
    """
    out = set()
    for m in models:
        if native_blocker(m, settings):
            continue
        if confirmed is not None and m.cluster in confirmed and not set(m.endpoints) & confirmed[m.cluster]:
            continue
        out.add(m.key)
    return frozenset(out)


def may_go_native(models: Iterable[RoutedModel], settings: GatewaySettings) -> bool:
    """Whether any model asks for the native path where the gateway allows it: the listener then
    has what native routes need. It follows the manifests only, not warm and cold, so the
    listener (whose updates drain connections) does not change when a model wakes or sleeps, and
    a gateway whose models are all decided has exactly the listener it had before."""
    return settings.native_allowed and any(m.path == "native" for m in models)
