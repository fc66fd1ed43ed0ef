"""A model's Envoy cluster (load balancing, TLS to federation members, member tokens) and its
endpoints (the load assignment).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2

from wakegate import contract
from wakegate.control.feeder.envoy_types import parse
from wakegate.control.feeder.routed import RoutedModel, UpstreamTls
from wakegate.control.feeder.settings import GatewaySettings
from wakegate.envoycounters import stat_name

_ROUND_ROBIN_TYPE = "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"


def envoy_always_picks(model: RoutedModel) -> bool:
    """Whether extproc never names an endpoint for `model`: round robin with no scoring and no
    adapters, so every pick is Envoy's own. Its cluster then has no override_host wrapper
    (a header and a metadata lookup on every request, native or decided, for nothing)."""
    return (
        model.strategy == "round-robin"
        and not model.profile
        and not model.weights
        and not model.adapters
        and not model.lora_adapters
        and not model.adapters_on_demand
    )


def model_cluster(model: RoutedModel, settings: GatewaySettings) -> cluster_pb2.Cluster:
    fallback = (
        "envoy.load_balancing_policies.least_request"
        if model.strategy == "least-loaded"
        else "envoy.load_balancing_policies.round_robin"
    )
    # least-loaded: every endpoint compared (not two sampled), ties split at random, so Envoy's own
    # pick, which a native least-loaded model gets, is the endpoint with the fewest of its requests.
    fallback_config: dict[str, Any] = (
        {
            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest",
            "selection_method": "FULL_SCAN",
        }
        if model.strategy == "least-loaded"
        else {"@type": _ROUND_ROBIN_TYPE}
    )
    return parse(
        cluster_pb2.Cluster(),
        {
            "name": model.cluster,
            "alt_stat_name": stat_name(model.key),
            "type": "EDS",
            "eds_cluster_config": {"eds_config": {"ads": {}, "resource_api_version": "V3"}},
            "connect_timeout": f"{settings.upstream_connect_timeout_ms / 1000:.3f}s",
            "per_connection_buffer_limit_bytes": 1024 * 1024,
            "circuit_breakers": {
                "thresholds": [
                    {
                        # HTTP/1.1 upstreams take one connection per request in flight: past this
                        # many, requests wait in Envoy's queue instead of opening more sockets
                        # (thousands of held requests released at once would exhaust fds).
                        "max_connections": settings.upstream_max_connections,
                        "max_pending_requests": 100000,
                        "max_requests": 100000,
                        # Retries (a federation's failover to another member) only repeat a
                        # request no model server began, or one an upstream gateway marked
                        # unserved, each a few times at most: one per request in flight may be
                        # retrying at once. Envoy's default (3 at a time) turned the 4th of a
                        # burst failing over from a dead member into a 503.
                        "max_retries": 100000,
                    }
                ]
            },
            "load_balancing_policy": _round_robin_only()
            if envoy_always_picks(model)
            else {
                "policies": [
                    {
                        "typed_extension_config": {
                            "name": "envoy.load_balancing_policies.override_host",
                            "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies"
                                ".override_host.v3.OverrideHost",
                                "override_host_sources": [
                                    {"header": contract.DESTINATION_HEADER},
                                    {
                                        "metadata": {
                                            "key": contract.LB_METADATA_NAMESPACE,
                                            "path": [{"key": contract.DESTINATION_HEADER}],
                                        }
                                    },
                                ],
                                "fallback_policy": {
                                    "policies": [
                                        {
                                            "typed_extension_config": {
                                                "name": fallback,
                                                "typed_config": fallback_config,
                                            }
                                        }
                                    ]
                                },
                            },
                        }
                    }
                ]
            },
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "common_http_protocol_options": {"idle_timeout": "60s"},
                    "explicit_http_config": {"http_protocol_options": {}},
                    **(_endpoint_authorization() if model.endpoint_authorization else {}),
                }
            },
            **(_transport_socket_matches(model.endpoint_tls) if model.endpoint_tls else {}),
        },
    )


def _round_robin_only() -> dict[str, Any]:
    """Envoy's round robin alone (`envoy_always_picks`)."""
    return {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.round_robin",
                    "typed_config": {"@type": _ROUND_ROBIN_TYPE},
                }
            }
        ]
    }


#: Endpoint metadata key the TLS transport socket matches on (`endpoint_tls`).
TLS_MATCH_KEY = "wakegate.member"


def _transport_socket_matches(endpoints: Iterable[tuple[str, int, UpstreamTls]]) -> dict[str, Any]:
    """One TLS transport socket per member (matched by its endpoints' metadata), each trusting only
    that member's CA and checking its name; endpoints without the metadata stay plain text."""
    matches = []
    for tls in sorted({t for _, _, t in endpoints}, key=lambda t: t.name):
        san = ("DNS", tls.server_name) if tls.server_name else ("IP_ADDRESS", tls.ip_san or "")
        common: dict[str, Any] = {
            "validation_context": {
                "trusted_ca": {"filename": tls.ca_file},
                "match_typed_subject_alt_names": [{"san_type": san[0], "matcher": {"exact": san[1]}}],
            }
        }
        if tls.cert_file and tls.key_file:
            common["tls_certificates"] = [
                {"certificate_chain": {"filename": tls.cert_file}, "private_key": {"filename": tls.key_file}}
            ]
        context: dict[str, Any] = {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "common_tls_context": common,
        }
        if tls.server_name:
            context["sni"] = tls.server_name
        matches.append(
            {
                "name": f"tls-{tls.name}",
                "match": {TLS_MATCH_KEY: tls.name},
                "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": context},
            }
        )
    return {"transport_socket_matches": matches}


#: EDS metadata namespace of what Envoy adds to requests to one endpoint (`endpoint_authorization`).
ENDPOINT_METADATA = "wakegate"


def _endpoint_metadata(model: RoutedModel) -> dict[tuple[str, int], dict[str, Any]]:
    """Each endpoint's EDS metadata: its authorization (`endpoint_authorization`), its TLS match."""
    metadata: dict[tuple[str, int], dict[str, Any]] = {}
    for ip, port, value in model.endpoint_authorization:
        if value:
            metadata.setdefault((ip, port), {})[ENDPOINT_METADATA] = {"authorization": value}
    for ip, port, tls in model.endpoint_tls:
        metadata.setdefault((ip, port), {})["envoy.transport_socket_match"] = {TLS_MATCH_KEY: tls.name}
    return metadata


def load_assignment(model: RoutedModel) -> endpoint_pb2.ClusterLoadAssignment:
    metadata = _endpoint_metadata(model)
    return parse(
        endpoint_pb2.ClusterLoadAssignment(),
        {
            "cluster_name": model.cluster,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {"address": {"socket_address": {"address": ip, "port_value": port}}},
                            "health_status": "HEALTHY",
                            **({"metadata": {"filter_metadata": found}} if (found := metadata.get((ip, port))) else {}),
                        }
                        for ip, port in sorted(model.endpoints)
                    ]
                }
            ],
        },
    )


def _endpoint_authorization() -> dict[str, Any]:
    """Upstream filters that set `authorization` from the picked endpoint's EDS metadata (a member
    gateway's token), replacing the client's; no metadata, no header."""
    return {
        "http_filters": [
            {
                "name": "envoy.filters.http.header_mutation",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
                    "mutations": {
                        "request_mutations": [
                            {
                                "append": {
                                    "header": {
                                        "key": "authorization",
                                        "value": f'%UPSTREAM_METADATA(["{ENDPOINT_METADATA}", "authorization"])%',
                                    },
                                    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                                }
                            }
                        ]
                    },
                },
            },
            {
                "name": "envoy.filters.http.upstream_codec",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.upstream_codec.v3.UpstreamCodec"
                },
            },
        ]
    }
