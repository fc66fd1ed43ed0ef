"""The gateway's Envoy listener (and the internal replay listener): its HTTP filter chain, with
extproc, the access log to every extproc, and what native routes and Envoy's buckets need.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from envoy.config.listener.v3 import listener_pb2

from wakegate import contract
from wakegate.control.feeder.envoy_types import LISTENER_NAME, ROUTE_NAME, parse
from wakegate.control.feeder.keys import API_KEY_AUTH_FILTER
from wakegate.control.feeder.ratelimit import HEADER_MUTATION_FILTER, local_rate_limit
from wakegate.control.feeder.replies import local_replies
from wakegate.control.feeder.routed import RoutedModel
from wakegate.control.feeder.settings import GatewaySettings


def processing_mode(request_body: str) -> dict[str, str]:
    return {
        "request_header_mode": "SEND",
        "response_header_mode": "SKIP",
        "request_body_mode": request_body,
        "response_body_mode": "NONE",
        "request_trailer_mode": "SKIP",
        "response_trailer_mode": "SKIP",
    }


#: Retries of what Envoy sends an extproc (its ext_proc streams, the parked requests): on the next
#: priority, the standby, when the first could not be reached or reset the stream.
EXTPROC_RETRY: dict[str, Any] = {
    "num_retries": 2,
    "retry_on": "connect-failure,refused-stream,reset",
    "retry_back_off": {"base_interval": "0.01s", "max_interval": "0.05s"},
    "retry_priority": {
        "name": "envoy.retry_priorities.previous_priorities",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.retry.priority.previous_priorities.v3"
            ".PreviousPrioritiesConfig",
            "update_frequency": 1,
        },
    },
}


#: The last HTTP filter of every listener: Envoy's router.
ROUTER_FILTER = {
    "name": "envoy.filters.http.router",
    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
}


def http_listener(name: str, host: str, port: int | str, hcm: dict[str, Any]) -> dict[str, Any]:
    """A listener with one HTTP connection manager (`hcm`: its config without the type)."""
    typed = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
        ".HttpConnectionManager",
        **hcm,
    }
    return {
        "name": name,
        "address": {"socket_address": {"address": host, "port_value": port}},
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": typed}]}
        ],
    }


def _completion_log(cluster: str, native: bool = False) -> dict[str, Any]:
    """Envoy's gRPC access logger to one extproc: every request, sent as it ends. With `native`,
    the natively routed ones are left out (extproc never saw them: their entries would only cost
    it CPU); otherwise unfiltered on purpose: a request extproc counted whose routing mutation
    Envoy refused still ends here."""
    unless_native = {
        "filter": {
            "header_filter": {"header": {"name": contract.NATIVE_HEADER, "present_match": True, "invert_match": True}}
        }
    }
    return {
        "name": "envoy.access_loggers.http_grpc",
        **(unless_native if native else {}),
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {
                "log_name": "wakegate-completions",
                "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": cluster}},
                # Unbatched: a finished request releases its endpoint for least-loaded picking at once.
                "buffer_size_bytes": 0,
                "buffer_flush_interval": "0.05s",
            },
        },
    }


JSON_TO_METADATA = "envoy.filters.http.json_to_metadata"


#: Reads the body's `model` into dynamic metadata for the native routes (route_configuration).
#: In the chain only where some model asks for the native path (`may_go_native`); then every
#: route turns it off but the catch-all, and that one too while no model is native now. (A
#: filter off by default cannot be turned on by a route: Envoy refuses an empty per-route
#: FilterConfig, and this filter takes no per-route config.)
_JSON_TO_METADATA_FILTER = {
    "name": JSON_TO_METADATA,
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.json_to_metadata.v3.JsonToMetadata",
        "request_rules": {
            # Any JSON media type, parameters too (`application/json; charset=utf-8`, as many
            # clients send it): the filter's default takes only the bare `application/json`,
            # which left such requests decided (and counted by extproc's bucket, not Envoy's).
            "allow_content_types_regex": {"regex": r"(?i)application/json\s*(;.*)?"},
            "rules": [
                {
                    "selectors": [{"key": "model"}],
                    "on_present": {
                        "metadata_namespace": contract.NATIVE_METADATA_NAMESPACE,
                        "key": "model",
                        "type": "STRING",
                    },
                }
            ],
        },
    },
}


def listener(
    settings: GatewaySettings,
    native: bool = False,
    rate_limited: Sequence[RoutedModel] = (),
    *,
    replayed: bool = False,
) -> listener_pb2.Listener:
    """The gateway's listener; `native` (may_go_native) adds what native routes need, `rate_limited`
    (envoy_rate_limited) the buckets of those models, before extproc: a request over its model's
    limit is refused before it could wait for a cold start, as extproc refuses it. Buckets need
    what native routes need (the body's `model` read before extproc, keys checked first), so
    `rate_limited` alone sets up the listener as `native` does. `replayed`: the replay listener
    instead (`replay_listener`)."""
    native = native or bool(rate_limited)
    # With replay, a failed ext_proc stream lets the request go on to its undecided route, which
    # sends it through the replay listener (route_configuration); there, a failure is the 503.
    replays = settings.replay and not replayed
    http_filters: list[dict[str, Any]] = [
        *([_JSON_TO_METADATA_FILTER] if native else []),
        *([API_KEY_AUTH_FILTER] if native and settings.key_checks else []),
        *([local_rate_limit(rate_limited, settings), HEADER_MUTATION_FILTER] if rate_limited else []),
        {
            "name": "envoy.filters.http.ext_proc",
            # With native routes, off unless the route turns it on (every route but the native
            # ones does, route_configuration): Envoy then does not even create the filter for a
            # native request, which cost ~50 us of Envoy CPU per request when each native route
            # only switched it off (docs/performance.md).
            **({"disabled": True} if native else {}),
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                "grpc_service": {
                    "envoy_grpc": {"cluster_name": contract.EXTPROC_CLUSTER},
                    "timeout": "5s",
                    # A stream that cannot reach an extproc (it just died, before health checks
                    # noticed) is opened again on the next priority: the standby. (A host
                    # predicate as well cost ~30 us of Envoy CPU per request and added nothing
                    # with one host per priority; docs/performance.md.)
                    "retry_policy": EXTPROC_RETRY,
                },
                "failure_mode_allow": replays,
                # Bodies are buffered unless the route says the model is named in the request's
                # headers (route_configuration): a body that arrives while extproc decides on the
                # headers is then held under the size limit (413 past it). Buffering only once
                # extproc asked for it left an oversized body that had already arrived paused by
                # flow control, with no answer (docs/decisions.md).
                "processing_mode": processing_mode("BUFFERED"),
                "allow_mode_override": True,
                # What a budgeted tenant's response used (extproc/budget.py), for the access log
                # that carries it to every extproc.
                "metadata_options": {"receiving_namespaces": {"untyped": [contract.USAGE_METADATA_NAMESPACE]}},
                "message_timeout": f"{settings.extproc_message_timeout_ms / 1000:.3f}s",
                "max_message_timeout": f"{settings.max_hold_seconds}s",
                "route_cache_action": "CLEAR",
            },
        },
        *settings.extra_listener_filters,
        ROUTER_FILTER,
    ]
    hcm = {
        "stat_prefix": "wakegate_replayed" if replayed else "wakegate",
        "codec_type": "AUTO",
        "rds": {"route_config_name": ROUTE_NAME, "config_source": {"ads": {}, "resource_api_version": "V3"}},
        "http_filters": http_filters,
        "stream_idle_timeout": f"{settings.stream_idle_timeout_s}s",
        "request_timeout": "0s",
        "normalize_path": True,
        "merge_slashes": True,
        "path_with_escaped_slashes_action": "KEEP_UNCHANGED",
        "use_remote_address": True,
        "local_reply_config": local_replies(bool(rate_limited), native and settings.key_checks),
        # A malformed HTTP/2 request resets its own stream (RFC 9113, 8.1.1), not the connection
        # with every other stream on it; HTTP/1 gets its shaped 400 and the connection closes.
        "http2_protocol_options": {"override_stream_error_on_invalid_http_message": True},
        # Request ids are Envoy's own UUIDs: a client's x-request-id is dropped before Envoy assigns
        # one, so extproc can key in-flight requests on it (extproc/completions.py).
        "early_header_mutation_extensions": [
            {
                "name": "envoy.http.early_header_mutation.header_mutation",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3"
                    ".HeaderMutation",
                    # With native routes, a client's x-wakegate-native would hide its request from
                    # extproc's access log (see _completion_log), and its destination header would
                    # pick the backend on a native route (extproc drops it on the decided path):
                    # only Envoy's native routes and extproc set them. Its cluster header is
                    # dropped too: extproc is off by default there, and only extproc names a
                    # cluster (the cluster_header route turns extproc on all the same).
                    "mutations": [
                        {"remove": "x-request-id"},
                        *(
                            [
                                {"remove": contract.NATIVE_HEADER},
                                {"remove": contract.DESTINATION_HEADER},
                                {"remove": contract.CLUSTER_HEADER},
                            ]
                            if native
                            else []
                        ),
                        # A client's copy would spare its request extproc's token; on the replay
                        # listener it is the gateway's own, from the first pass.
                        *([{"remove": contract.RATE_COUNTED_HEADER}] if rate_limited and not replayed else []),
                        # Only the gateway's replay route sends a request through again.
                        *([{"remove": contract.REPLAY_HEADER}] if replays else []),
                    ],
                },
            }
        ],
        "access_log": [_completion_log(cluster, native) for cluster in settings.access_log_clusters],
    }
    config = http_listener(LISTENER_NAME, settings.listen_host, settings.listen_port, hcm)
    if replayed:
        del config["address"]
        config.update(name=contract.REPLAY_LISTENER, internal_listener={})
    return parse(
        listener_pb2.Listener(),
        {**config, "per_connection_buffer_limit_bytes": settings.max_request_bytes + 64 * 1024},
    )


def replay_listener(
    settings: GatewaySettings, native: bool = False, rate_limited: Sequence[RoutedModel] = ()
) -> listener_pb2.Listener:
    """The internal listener (reached only from this Envoy, through REPLAY_CLUSTER) a request goes
    through again when its ext_proc stream failed before extproc decided it: the same filters and
    routes as the gateway's listener, so the request is checked, decided and held anew by
    whichever extproc Envoy reaches now. What differs: the gateway's own marks stay on the request
    (REPLAY_HEADER, which picks the replay route, and RATE_COUNTED_HEADER: its token was taken on
    the first pass), and a failed ext_proc stream here is the retriable 503 marked unserved,
    which the first pass's replay route retries (route_configuration)."""
    return listener(settings, native, rate_limited, replayed=True)
