"""What one gateway's Envoy is set up with, the same for every model: `GatewaySettings`, and the
API keys its native routes check (`GatewayKey`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from wakegate import contract
from wakegate.keyfile import Scope


@dataclass(frozen=True)
class GatewaySettings:
    """Shape of the Envoy listener; the same for every model."""

    listen_host: str = "127.0.0.1"
    listen_port: int = 8080
    #: Largest request body the gateway buffers to read `model`, bytes.
    max_request_bytes: int = 8 * 1024 * 1024
    #: Upper bound extproc may hold a cold request (override_message_timeout).
    max_hold_seconds: int = 3600
    #: Per-exchange timeout for extproc when it does not ask for more. Generous: under a burst of
    #: thousands of new requests extproc may answer late, and late beats a 504.
    extproc_message_timeout_ms: int = 10000
    #: Idle timeout of a stream (0 disables); long generations send tokens often.
    stream_idle_timeout_s: int = 300
    upstream_connect_timeout_ms: int = 2000
    #: Connections Envoy opens to one model's backends at most; more requests queue in Envoy.
    upstream_max_connections: int = 1024
    #: Add `x-wakegate-upstream: ip:port` to responses (debugging; reveals backend addresses).
    upstream_header: bool = False
    extra_listener_filters: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    #: Static clusters of the extproc processes' access-log services (the bootstrap's); every
    #: finished request is logged to each, unbatched: extproc's in-flight counts end there.
    access_log_clusters: tuple[str, ...] = (contract.access_log_cluster(0),)
    #: Other upstreams a request is tried on when one cannot be connected to or resets before the
    #: request was sent (never after: nothing reached the client yet); 0: none. The federation's
    #: global gateway sets it, its upstreams being whole member gateways.
    upstream_retries: int = 0
    #: Envoy's retry_on for those retries; `reset` (before the response began) may repeat a request
    #: an upstream had started on, never one whose answer reached the client.
    upstream_retry_on: str = "connect-failure,refused-stream,reset-before-request"
    #: Models may take the native path (Envoy routes them alone): `wakegate up` always (its feeder
    #: gives the native routes the keys extproc checks); `wakegate xds --native-path`, which the
    #: chart sets only for a gateway with no API keys and no global rate limit.
    native_allowed: bool = False
    #: Requests must carry a key of the gateway's key file: native routes check it with Envoy's
    #: api_key_auth, from the `GatewayKey`s `build` is given (never in these settings, which
    #: travel in a command line).
    key_checks: bool = False
    #: extproc keeps a gateway-wide token bucket (`--global-rps`): every request must meet it, so
    #: no model takes the native path (Envoy's buckets are per model only).
    global_rate_limit: bool = False
    #: The gateway-wide bucket (`--global-rps`, `--global-burst`; 0: none) kept in Envoy's local
    #: rate limit for every request a counted route names the model of (envoy_rate_limited): one
    #: bucket whichever extproc a request reaches. extproc keeps its own for the rest.
    global_rps: float = 0.0
    global_burst: float = 0.0
    #: A request whose ext_proc stream fails before extproc decided it (the extproc holding it
    #: died or stalled) goes through this Envoy again, on the internal listener REPLAY_LISTENER,
    #: where the other (or the restarted) extproc decides it: the request reached no model server
    #: yet, so nothing runs twice (`replay_listener`). Needs the bootstrap's internal listener
    #: extension and REPLAY_CLUSTER: `wakegate up` sets it.
    replay: bool = False


@dataclass(frozen=True)
class GatewayKey:
    """One API key as Envoy's native routes check it; the key itself never in a repr."""

    #: The non-secret id api_key_auth knows the key by (routes allow clients, not keys).
    client: str
    key: str = field(repr=False)
    #: The models it may use, by extproc's own rule (`Scope.allows`).
    scope: Scope


def gateway_keys(entries: Iterable[tuple[str, Scope]]) -> tuple[GatewayKey, ...]:
    """The key file's (key, scope) entries as Envoy's credentials, each named `k<n>` by its place."""
    return tuple(GatewayKey(f"k{n}", key, scope) for n, (key, scope) in enumerate(entries))
