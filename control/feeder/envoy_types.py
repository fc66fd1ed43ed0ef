"""The Envoy resource types the feeder serves: their type URLs, the fixed resource names, and
reading a resource from its JSON form (the generated modules are imported here so `json_format`
resolves every `@type` inside an Any).
"""

from __future__ import annotations

from typing import Any, TypeVar

# Importing the generated modules registers their types in the default pool, which
# json_format needs to resolve "@type" inside Any fields.
from envoy.extensions.access_loggers.filters.cel.v3 import cel_pb2  # noqa: F401
from envoy.extensions.access_loggers.grpc.v3 import als_pb2  # noqa: F401
from envoy.extensions.filters.http.api_key_auth.v3 import api_key_auth_pb2  # noqa: F401
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2  # noqa: F401
from envoy.extensions.filters.http.header_mutation.v3 import header_mutation_pb2 as upstream_header_mutation_pb2  # noqa: F401
from envoy.extensions.filters.http.json_to_metadata.v3 import json_to_metadata_pb2  # noqa: F401
from envoy.extensions.filters.http.local_ratelimit.v3 import local_rate_limit_pb2  # noqa: F401
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401
from envoy.extensions.filters.http.upstream_codec.v3 import upstream_codec_pb2  # noqa: F401
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2  # noqa: F401
from envoy.extensions.http.early_header_mutation.header_mutation.v3 import header_mutation_pb2  # noqa: F401
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2  # noqa: F401
from envoy.extensions.load_balancing_policies.override_host.v3 import override_host_pb2  # noqa: F401
from envoy.extensions.load_balancing_policies.round_robin.v3 import round_robin_pb2  # noqa: F401
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2  # noqa: F401
from envoy.extensions.retry.priority.previous_priorities.v3 import previous_priorities_config_pb2  # noqa: F401
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2  # noqa: F401
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2  # noqa: F401
from google.protobuf import any_pb2, json_format
from google.protobuf.message import Message

from wakegate import contract

M = TypeVar("M", bound=Message)


LISTENER = "type.googleapis.com/envoy.config.listener.v3.Listener"


ROUTE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"


CLUSTER = "type.googleapis.com/envoy.config.cluster.v3.Cluster"


ENDPOINT = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


MODEL_ROUTE = contract.MODEL_ROUTE_TYPE


#: Types a client gets in full on every response (no resource names asked).
WILDCARD_TYPES = frozenset({LISTENER, CLUSTER, MODEL_ROUTE})


LISTENER_NAME = "wakegate_http"


ROUTE_NAME = "wakegate_routes"


def pack(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def parse(message: M, data: dict[str, Any]) -> M:
    json_format.ParseDict(data, message)
    return message
