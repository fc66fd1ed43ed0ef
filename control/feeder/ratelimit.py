"""Request rate limits kept in Envoy (its local rate limit filter): which models' buckets Envoy
keeps, the buckets, and the route metadata that names them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from wakegate.control.feeder.routed import RoutedModel
from wakegate.control.feeder.settings import GatewaySettings

#: Route metadata namespace: the model whose bucket in Envoy's local rate limit a route draws from
#: (`model`, its key) and the Retry-After of a refusal there (`retry_after`).
RATE_LIMIT_METADATA = "wakegate.ratelimit"


LOCAL_RATE_LIMIT = "envoy.filters.http.local_ratelimit"


HEADER_MUTATION = "envoy.filters.http.header_mutation"


_RATE_LIMIT_DESCRIPTOR = "wakegate_model"


_UINT32_MAX = 2**32 - 1


_ALWAYS = {"default_value": {"numerator": 100, "denominator": "HUNDRED"}}


def envoy_rate_limited(models: Iterable[RoutedModel], settings: GatewaySettings) -> tuple[RoutedModel, ...]:
    """Models whose per-model bucket Envoy's local rate limit keeps (and extproc's does not, for
    the requests Envoy counted): every model with a limit, native or decided, wherever the
    gateway lets Envoy route before extproc (`native_allowed`: it has the keys extproc checks).
    One bucket in Envoy, before either extproc, is what keeps a limit exact while Envoy sends a
    request to the standby extproc (at start-up, on a failover); each extproc's own buckets
    would split it. A model with adapters stays with extproc: requests naming an adapter reach
    only extproc, and two buckets would split its limit just the same. Like may_go_native it
    follows the manifests only, so the listener that holds the buckets does not change when a
    model wakes or sleeps."""
    if not settings.native_allowed:
        return ()
    # With the gateway-wide bucket in Envoy every model's requests draw from it (a model without
    # a limit of its own: the global bucket only).
    limited = (
        m
        for m in models
        if (m.requests_per_second > 0 or settings.global_rps > 0) and not (m.adapters or m.lora_adapters)
    )
    return tuple(sorted(limited, key=lambda m: m.key))


def token_bucket(rate: float, burst: float) -> dict[str, Any]:
    """Envoy's TokenBucket closest to extproc's bucket of `rate` tokens/s and `burst` (0: max(1,
    rate); extproc/ratelimit.py). Envoy refills continuously at tokens_per_fill / fill_interval
    (fill_interval in whole milliseconds, at least 50 ms): tokens_per_fill = ceil(rate) keeps the
    interval at 1 s or more, so rounding it to the millisecond changes the rate by 0.05% at most.
    Envoy's max_tokens is a whole number: a fractional burst is rounded down (never more admitted
    at once than extproc would)."""
    tokens_per_fill = min(max(1, math.ceil(rate)), _UINT32_MAX)
    interval_ms = max(50, round(1000 * tokens_per_fill / rate))
    return {
        "max_tokens": min(max(1, math.floor(burst or max(1.0, rate))), _UINT32_MAX),
        "tokens_per_fill": tokens_per_fill,
        "fill_interval": f"{interval_ms / 1000:.3f}s",
    }


def refused_retry_after(rate: float) -> str:
    """The Retry-After of a request Envoy's bucket refuses. Envoy cannot compute the wait as
    extproc does (ceil((1 - tokens) / rate), at least 1): it answers the longest such wait,
    ceil(1 / rate), the same "1" extproc answers for any rate of 1/s or more."""
    return str(max(1, math.ceil(1 / rate - 1e-9)))


def rate_limit_metadata(model: RoutedModel, global_rps: float = 0.0) -> dict[str, Any]:
    """The buckets a route draws from: the model's where it has a limit (`model`), the gateway-wide
    one where Envoy keeps it (`global`); a refusal's Retry-After is the slower bucket's."""
    rates = [rate for rate in (model.requests_per_second, global_rps) if rate > 0]
    found: dict[str, str] = {"retry_after": refused_retry_after(min(rates))}
    if model.requests_per_second > 0:
        found["model"] = model.key
    if global_rps > 0:
        found["global"] = _GLOBAL
    return {"filter_metadata": {RATE_LIMIT_METADATA: found}}


#: The descriptor value of the gateway-wide bucket (`--global-rps`) in Envoy's local rate limit.
_GLOBAL = "all"


_GLOBAL_DESCRIPTOR = "wakegate_global"


def _descriptor_of(key: str, descriptor: str) -> dict[str, Any]:
    """A rate_limits entry: the descriptor `descriptor` valued with the route's metadata `key` (none
    for a route without it)."""
    return {
        "actions": [
            {
                "metadata": {
                    "descriptor_key": descriptor,
                    "metadata_key": {"key": RATE_LIMIT_METADATA, "path": [{"key": key}]},
                    "source": "ROUTE_ENTRY",
                }
            }
        ]
    }


def local_rate_limit(limited: Sequence[RoutedModel], settings: GatewaySettings) -> dict[str, Any]:
    """Envoy's local rate limit with one bucket per model of `limited` that has a limit, shared by
    every route whose metadata names the model (native and decided alike), and the gateway-wide
    bucket where `settings` put it here, shared by every route whose metadata says `global`;
    requests of other routes take no token. Envoy tries the slower bucket first: a request it
    refuses takes nothing from the other. Its 429 is shaped by the local reply mapper
    (`RATE_LIMITED_REPLY`)."""
    has_global = settings.global_rps > 0
    glob = (
        [
            {
                "entries": [{"key": _GLOBAL_DESCRIPTOR, "value": _GLOBAL}],
                "token_bucket": token_bucket(settings.global_rps, settings.global_burst),
            }
        ]
        if has_global
        else []
    )
    return {
        "name": LOCAL_RATE_LIMIT,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
            "stat_prefix": "wakegate_models",
            "filter_enabled": _ALWAYS,
            "filter_enforced": _ALWAYS,
            "always_consume_default_token_bucket": False,
            "rate_limits": [
                _descriptor_of("model", _RATE_LIMIT_DESCRIPTOR),
                *([_descriptor_of("global", _GLOBAL_DESCRIPTOR)] if has_global else []),
            ],
            "descriptors": [
                *(
                    {
                        "entries": [{"key": _RATE_LIMIT_DESCRIPTOR, "value": m.key}],
                        "token_bucket": token_bucket(m.requests_per_second, m.burst),
                    }
                    for m in limited
                    if m.requests_per_second > 0
                ),
                *glob,
            ],
            "response_headers_to_add": [
                {
                    "header": {"key": "retry-after", "value": f"%METADATA(ROUTE:{RATE_LIMIT_METADATA}:retry_after)%"},
                    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                }
            ],
        },
    }


#: Sets RATE_COUNTED_HEADER where a decided route says so (`_counted`): extproc, next in the chain,
#: then takes no token of its own. No mutation of its own elsewhere.
HEADER_MUTATION_FILTER = {
    "name": HEADER_MUTATION,
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
        "mutations": {},
    },
}
