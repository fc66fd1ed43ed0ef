"""The gateway's one Envoy route table: the decided routes (extproc names the cluster), the
native routes Envoy serves alone, the routes counted by Envoy's buckets, and replays.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from envoy.config.route.v3 import route_pb2

from wakegate import contract
from wakegate.control.feeder.envoy_types import ROUTE_NAME, parse
from wakegate.control.feeder.keys import BEARER_KEY, key_check, routable_names
from wakegate.control.feeder.listeners import EXTPROC_RETRY, processing_mode
from wakegate.control.feeder.ratelimit import HEADER_MUTATION, rate_limit_metadata
from wakegate.control.feeder.routed import RoutedModel
from wakegate.control.feeder.settings import GatewayKey, GatewaySettings

UPSTREAM_HEADER = "x-wakegate-upstream"


_MODEL_HEADER_SET = {"name": contract.MODEL_HEADER, "string_match": {"safe_regex": {"regex": ".+"}}}


_NO_ROUTE: dict[str, Any] = {
    "direct_response": {
        "status": 404,
        # Shaped by the listener's local_reply_config (404: `no_route`).
        "body": {"inline_string": "no route"},
    }
}


_JSON_TO_METADATA_OFF = {
    "envoy.filters.http.json_to_metadata": {
        "@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig",
        "disabled": True,
    }
}


#: Turns extproc on for a route where the listener has it off by default (a listener with native
#: routes, `listener`): every route but the native ones carries this or another extproc config.
_EXTPROC_ON = {
    "envoy.filters.http.ext_proc": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
        "overrides": {},
    }
}


_EXTPROC_OFF = {
    "envoy.filters.http.ext_proc": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
        "disabled": True,
    }
}


_STREAM_BODY: dict[str, Any] = {
    "typed_per_filter_config": {
        "envoy.filters.http.ext_proc": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
            "overrides": {"processing_mode": processing_mode("NONE")},
        },
    }
}


_POST = {"name": ":method", "string_match": {"exact": "POST"}}


_NO_MODEL_HEADER = {"name": contract.MODEL_HEADER, "present_match": True, "invert_match": True}


#: Names a native /model/<name>/ route is made for: what needs no percent-decoding in a path.
_PLAIN_NAME = re.compile(r"[A-Za-z0-9._~:@!$&'()*+,;=-]+")


def _bearer_catch_all(keys: Sequence[GatewayKey]) -> dict[str, Any]:
    """The catch-all of POSTs in the Bearer form where body routes check keys. Envoy makes a
    request's filters from the route it first matches, before json_to_metadata has read the body:
    api_key_auth exists for a body-named request only if that first route asks for it. This one
    does, with every key allowed, so a request the body then routes natively is checked by its
    native route, and one the body leaves here goes to extproc (an unknown key: the same 401)."""
    return {
        **_NO_ROUTE,
        "name": "bearer",
        "match": {"prefix": "/", "headers": [_POST, BEARER_KEY]},
        "typed_per_filter_config": {**key_check(keys), **_EXTPROC_ON},
    }


def _native(
    model: RoutedModel,
    name: str,
    match: dict[str, Any],
    extra: dict[str, Any] | None = None,
    keys: Sequence[GatewayKey] | None = None,
    *,
    second: bool = False,
    limited: bool = False,
) -> dict[str, Any]:
    """A route Envoy serves alone: straight to the model's cluster, extproc off, marked for the log.
    Named after the model name it matches; `keys` (not None): it checks them, in Bearer form only.
    `second`: a request meets it only after another route (the body routes, once json_to_metadata
    has read the body), which has turned extproc on; it is switched off here. `limited`: it draws
    from the model's bucket in Envoy's local rate limit."""
    if keys is not None:
        match = {**match, "headers": [*match["headers"], BEARER_KEY]}
    return {
        **({"metadata": rate_limit_metadata(model)} if limited else {}),
        "name": name,
        "match": match,
        "route": {"cluster": model.cluster, "timeout": "0s", **(extra or {})},
        "request_headers_to_add": [
            {"header": {"key": contract.NATIVE_HEADER, "value": "1"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
        ],
        # A route a request meets first names no extproc config at all: the listener has extproc
        # off by default, and any config of it here (even one saying disabled) would have Envoy
        # create the filter for the request (docs/performance.md, "The native path").
        "typed_per_filter_config": {
            **(_EXTPROC_OFF if second else {}),
            **_JSON_TO_METADATA_OFF,
            **(key_check(keys, model) if keys is not None else {}),
        },
    }


def _native_routes(
    models: Sequence[RoutedModel],
    keys: Sequence[GatewayKey] | None = None,
    limited: AbstractSet[str] = frozenset(),
) -> tuple[list[Any], list[Any], list[Any]]:
    """(by X-Model-ID, by /model/<name>/ path, by the body's `model`) routes of the native models.

    Only POSTs (extproc answers GETs like /v1/models itself). Each kind goes right before the
    decided route of the same kind, so the header beats the path beats the body, as in extproc.
    The body route takes only the name the engine serves: any other name needs extproc's
    rewrite of `model` (a header or path names the model without touching the body, as today).
    With `keys`, a name whose 404 Envoy could not word as extproc does stays decided.
    """
    by_header, by_path, by_body = [], [], []
    for m in sorted(models, key=lambda m: m.key):
        counted = m.key in limited and m.requests_per_second > 0  # a native route has no global bucket
        names = routable_names(m, keys)
        for name in names:
            by_header.append(_native(m, name, _by_header(name), keys=keys, limited=counted))
            if _PLAIN_NAME.fullmatch(name):
                by_path.append(_native(m, name, _by_path(name), {"prefix_rewrite": "/"}, keys=keys, limited=counted))
        if m.served_name in names:
            by_body.append(_native(m, m.served_name, _by_body(m.served_name), keys=keys, second=True, limited=counted))
    return by_header, by_path, by_body


def _by_header(name: str) -> dict[str, Any]:
    return {"prefix": "/", "headers": [{"name": contract.MODEL_HEADER, "string_match": {"exact": name}}, _POST]}


def _by_path(name: str) -> dict[str, Any]:
    return {"prefix": f"{contract.MODEL_PATH_PREFIX}{name}/", "headers": [_NO_MODEL_HEADER, _POST]}


def _by_body(name: str) -> dict[str, Any]:
    return {
        "prefix": "/",
        "headers": [_NO_MODEL_HEADER, _POST],
        "dynamic_metadata": [
            {
                "filter": contract.NATIVE_METADATA_NAMESPACE,
                "path": [{"key": "model"}],
                "value": {"string_match": {"exact": name}},
            }
        ],
    }


def _counted(
    model: RoutedModel,
    name: str,
    match: dict[str, Any],
    per_filter: dict[str, Any],
    keys: Sequence[GatewayKey] | None = None,
    global_rps: float = 0.0,
) -> dict[str, Any]:
    """A decided route (extproc decides, as on the catch-all) that draws the request's token from the
    model's bucket in Envoy (and the gateway-wide one, with `global_rps`) and tells extproc so
    (RATE_COUNTED_HEADER). With `keys` it takes only
    the Bearer form and Envoy checks the key and its scope first (a request refused for its key
    spends no token); the key stays on the request, for extproc's own check."""
    if keys is not None:
        match = {**match, "headers": [*match["headers"], BEARER_KEY]}
    mark = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutationPerRoute",
        "mutations": {
            "request_mutations": [
                {
                    "append": {
                        "header": {"key": contract.RATE_COUNTED_HEADER, "value": model.key},
                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                    }
                }
            ]
        },
    }
    return {
        **_NO_ROUTE,
        "name": name,
        "metadata": rate_limit_metadata(model, global_rps),
        "match": match,
        "typed_per_filter_config": {
            **_EXTPROC_ON,
            **per_filter,
            **_JSON_TO_METADATA_OFF,
            HEADER_MUTATION: mark,
            **(key_check(keys, model, hide=False) if keys is not None else {}),
        },
    }


def _counted_routes(
    limited: Sequence[RoutedModel],
    native: AbstractSet[str],
    keys: Sequence[GatewayKey] | None = None,
    global_rps: float = 0.0,
) -> tuple[list[Any], list[Any], list[Any]]:
    """(by X-Model-ID, by /model/<name>/ path, by the body's `model`) decided routes of the models
    whose bucket Envoy keeps, for every name, each kind right after its native twins: the POSTs
    they match (a native model's alias in the body, any name while the model is cold) take their
    token in Envoy, as a native request does. What none matches (other methods, a multipart form's
    `model`, a name the path can only carry %-encoded) takes its token in extproc."""
    by_header, by_path, by_body = [], [], []
    for m in limited:
        warm = m.key in native
        for name in routable_names(m, keys):  # extproc counts the others
            if not warm:  # a warm model's native routes take these
                streamed = _STREAM_BODY["typed_per_filter_config"]
                by_header.append(_counted(m, name, _by_header(name), streamed, keys, global_rps))
                if _PLAIN_NAME.fullmatch(name):
                    by_path.append(_counted(m, name, _by_path(name), streamed, keys, global_rps))
            if not (warm and name == m.served_name):
                by_body.append(_counted(m, name, _by_body(name), {}, keys, global_rps))
    return by_header, by_path, by_body


def route_configuration(
    settings: GatewaySettings,
    native: Sequence[RoutedModel] = (),
    *,
    body_metadata: bool = False,
    keys: Sequence[GatewayKey] = (),
    rate_limited: Sequence[RoutedModel] = (),
) -> route_pb2.RouteConfiguration:
    """The one route table. `native`: the models Envoy routes alone (native_keys); every other
    request finds no cluster until extproc names one. `body_metadata`: the listener has the
    json_to_metadata filter (may_go_native), which every route but the catch-all turns off.
    `keys`: the key file's, which native routes check where `settings.key_checks` (none there:
    every native request is refused, as extproc refuses all with an empty file).
    `rate_limited`: the models whose bucket Envoy keeps (envoy_rate_limited)."""
    off = _JSON_TO_METADATA_OFF if body_metadata or native or rate_limited else {}
    extra: dict[str, Any] = {}
    if settings.upstream_header:
        extra["response_headers_to_add"] = [
            {
                "header": {"key": UPSTREAM_HEADER, "value": "%UPSTREAM_REMOTE_ADDRESS%"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            }
        ]
    checked = keys if settings.key_checks else None
    by_header, by_path, by_body = _native_routes(native, checked, {m.key for m in rate_limited})
    counted_header, counted_path, counted_body = _counted_routes(
        rate_limited, {m.key for m in native}, checked, settings.global_rps
    )
    stream_body = {"typed_per_filter_config": {**_STREAM_BODY["typed_per_filter_config"], **off}}
    # With native routes possible, extproc is off in the listener unless a route turns it on.
    on = _EXTPROC_ON if off else {}
    decided: dict[str, Any] = {"typed_per_filter_config": {**off, **on}} if off else {}
    catch_all: dict[str, Any] = {**_NO_ROUTE, "match": {"prefix": "/"}}
    if off and not native and not rate_limited:
        # With a native or rate-limited model, the body's `model` is read into metadata here, for
        # the body routes.
        catch_all["typed_per_filter_config"] = {**off, **on}
    elif on:
        catch_all["typed_per_filter_config"] = on
    routes: list[dict[str, Any]] = [
        {
            "match": {
                "prefix": "/",
                "headers": [{"name": contract.CLUSTER_HEADER, "present_match": True}],
            },
            "route": {
                "cluster_header": contract.CLUSTER_HEADER,
                "timeout": "0s",
                **_retry_policy(settings.upstream_retries, settings.upstream_retry_on),
            },
            **decided,
        },
        # A request a park sent back: decided by extproc, never by a native or counted route.
        {**_NO_ROUTE, "name": "released", "match": {"prefix": "/", "headers": [_RELEASED]}, **decided},
        # Before extproc has named a cluster: these pick how its filter treats the
        # body. A model named by the X-Model-ID header or a /model/<name>/ path
        # needs no body, so it streams through; everything else is buffered.
        *by_header,
        *counted_header,
        {**_NO_ROUTE, "match": {"prefix": "/", "headers": [_MODEL_HEADER_SET]}, **stream_body},
        *by_path,
        *counted_path,
        {**_NO_ROUTE, "match": {"prefix": contract.MODEL_PATH_PREFIX}, **stream_body},
        *by_body,
        *counted_body,
        *([_bearer_catch_all(keys)] if settings.key_checks and (by_body or counted_body) else []),
        catch_all,
    ]
    # Only this gateway's own replies may say a request reached no model server.
    unserved: dict[str, Any] = {"response_headers_to_remove": [contract.UNSERVED_HEADER]}
    if settings.replay:
        # Dropped from what model servers answer, route by route: a reply the replay listener
        # made keeps its mark through the first pass's replay route.
        routes = [
            {**routes[0], **unserved},
            {**_NO_ROUTE, "match": {"prefix": "/", "headers": [_REPLAYED]}, "typed_per_filter_config": {**off, **on}},
            *(_replays(r) if "direct_response" in r else {**r, **unserved} for r in routes[1:]),
        ]
        unserved = {}
    routes.insert(0, _park(off, on))
    return parse(
        route_pb2.RouteConfiguration(),
        {
            **extra,
            **unserved,
            "name": ROUTE_NAME,
            "virtual_hosts": [{"name": "models", "domains": ["*"], "routes": routes}],
        },
    )


_REPLAYED = {"name": contract.REPLAY_HEADER, "present_match": True}

#: A request a park sent back (its 307 set the release ticket). It goes to extproc whatever its
#: model's path: extproc checks the ticket and spares the request the token its first pass took (a
#: native or counted route would draw a second one from Envoy's bucket, and a native route would
#: never tell the park it came back, `Parker.back`). A client's own header only sends its request
#: to extproc, which finds no valid ticket and decides and counts it as any other.
_RELEASED = {"name": contract.RELEASE_HEADER, "present_match": True}


def _park(off: dict[str, Any], on: dict[str, Any]) -> dict[str, Any]:
    """Where extproc sends a cold request to wait (extproc/park.py): the extproc cluster, whose
    307 is followed inside Envoy (once), so the request goes through the filter chain again when
    its model is ready. The 307 clears the park's headers from the request it restarts, and the
    route drops the rate-counted mark before the request leaves: Envoy's header_mutation filter
    adds that header by reference to the name in the first pass's route, and the restarted request
    keeps its headers but not that route, which an RDS update (the model getting ready) frees. A
    parked request no extproc could hold (one died: a reset; one stopping: its unserved 503) is
    retried on the other, as ext_proc streams are; a stopping one's 503 keeps its mark if none is
    left."""
    return {
        "name": "park",
        "match": {
            "prefix": "/",
            "headers": [{"name": contract.CLUSTER_HEADER, "string_match": {"exact": contract.PARK_CLUSTER}}],
        },
        "route": {
            "cluster": contract.EXTPROC_CLUSTER,
            "timeout": "0s",
            # As persistent as the replay route: a parked request reached no model server, so it
            # is retried until an extproc holds it (both may be restarting).
            "retry_policy": {
                **EXTPROC_RETRY,
                "retry_on": f"{EXTPROC_RETRY['retry_on']},retriable-headers",
                "retriable_headers": [{"name": contract.UNSERVED_HEADER, "string_match": {"exact": "1"}}],
                "num_retries": REPLAY_ATTEMPTS,
                "retry_back_off": {"base_interval": "0.05s", "max_interval": "0.4s"},
            },
            "internal_redirect_policy": {
                "max_internal_redirects": 1,
                "redirect_response_codes": [307],
                "response_headers_to_copy": [contract.RELEASE_HEADER, contract.CLUSTER_HEADER, contract.PARK_HEADER],
            },
        },
        "request_headers_to_remove": [contract.RATE_COUNTED_HEADER],
        **({"typed_per_filter_config": {**off, **on}} if off else {}),
    }


#: Sends of one request through the replay listener at most. Each one that meets no extproc fails
#: within milliseconds; with the back-off below they span about 8 s: long enough for `up` to
#: restart an extproc that died while the other one was gone too.
REPLAY_ATTEMPTS = 30


def _replays(route: dict[str, Any]) -> dict[str, Any]:
    """An undecided route (one extproc decides on and names the cluster for) that, when it is
    reached after all, sends the request through the replay listener: that happens only when the
    request's ext_proc stream failed before extproc decided it (the listener lets such a request
    go on, `listener`), so no model server has seen it. Retried while the replay listener answers
    that no extproc could decide it (the unserved mark): each send is decided anew, by whichever
    extproc answers then. On the replay listener itself, the replayed route above takes the
    request first (a request is sent through again once at most)."""
    replayed = {k: v for k, v in route.items() if k != "direct_response"}
    return {
        **replayed,
        "route": {
            "cluster": contract.REPLAY_CLUSTER,
            "timeout": "0s",
            "retry_policy": {
                "retry_on": "retriable-headers,connect-failure,reset-before-request",
                "retriable_headers": [{"name": contract.UNSERVED_HEADER, "string_match": {"exact": "1"}}],
                "num_retries": REPLAY_ATTEMPTS,
                "retry_back_off": {"base_interval": "0.05s", "max_interval": "0.4s"},
            },
        },
        "request_headers_to_add": [
            {"header": {"key": contract.REPLAY_HEADER, "value": "1"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
        ],
    }


def _retry_policy(retries: int, retry_on: str) -> dict[str, Any]:
    """Retries before the response began (what `retry_on` allows), each on a host not tried yet
    (the pick's fallbacks in the destination header, `ModelRoute.fallback_endpoints`). An
    upstream gateway's reply marked unserved (contract.UNSERVED_HEADER: it reached no model
    server) is always retried too."""
    if retries <= 0:
        return {}
    return {
        "retry_policy": {
            "retry_on": f"{retry_on},retriable-headers",
            "retriable_headers": [{"name": contract.UNSERVED_HEADER, "string_match": {"exact": "1"}}],
            "num_retries": retries,
            "retry_back_off": {"base_interval": "0.01s", "max_interval": "0.05s"},
            "retry_host_predicate": [
                {
                    "name": "envoy.retry_host_predicates.previous_hosts",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3"
                        ".PreviousHostsPredicate"
                    },
                }
            ],
            "host_selection_retry_max_attempts": 5,
        }
    }


def natively_routed(config: route_pb2.RouteConfiguration) -> frozenset[str]:
    """Clusters a route table sends requests to without extproc (the native routes; not the replay
    route, whose requests an extproc decides on the replay listener)."""
    return frozenset(
        route.route.cluster
        for host in config.virtual_hosts
        for route in host.routes
        if route.route.cluster and route.route.cluster not in (contract.REPLAY_CLUSTER, contract.EXTPROC_CLUSTER)
    )
