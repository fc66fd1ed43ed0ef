"""API keys on Envoy's own routes: the per-route `api_key_auth` config and which model names a
route that checks keys may match.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from wakegate.control.feeder.routed import RoutedModel
from wakegate.control.feeder.settings import GatewayKey

API_KEY_AUTH = "envoy.filters.http.api_key_auth"


#: Checks API keys on the native routes, which switch it on with their own config (the keys go in
#: RDS: a listener update would drain connections at every rotation). After json_to_metadata, so a
#: route chosen by the body's `model` is the one it checks; before ext_proc, which decided
#: routes keep for their own check.
API_KEY_AUTH_FILTER = {
    "name": API_KEY_AUTH,
    "disabled": True,
    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.api_key_auth.v3.ApiKeyAuth"},
}


#: The one Authorization form both paths read alike: api_key_auth takes what follows exactly
#: "Bearer " (a bare key too), extproc also a lower-case scheme and several spaces, and no bare
#: key. With key checks a native route matches only this form; any other goes to extproc.
BEARER_KEY = {"name": "authorization", "string_match": {"safe_regex": {"regex": r"Bearer \S+"}}}


#: allowed_clients of a model no key may use (none given would allow every key).
_NO_CLIENT = "-"


def key_check(keys: Sequence[GatewayKey], model: RoutedModel | None = None, hide: bool = True) -> dict[str, Any]:
    """A route's api_key_auth: every key. For a `model`, only the keys whose scope has the model
    allowed, and (`hide`, a native route) the gateway's key kept from the backend (as extproc
    removes it); without a model, any key passes and extproc gets the header for its own check."""
    check: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.api_key_auth.v3.ApiKeyAuthPerRoute",
        "credentials": [{"key": k.key, "client": k.client} for k in keys],
        "key_sources": [{"header": "authorization"}],
    }
    if model is not None:
        own_name = model.names[0] if model.names else model.key
        allowed = [k.client for k in keys if k.scope.allows(model.key, own_name)]
        check["allowed_clients"] = allowed or [_NO_CLIENT]
        if hide:
            check["forwarding"] = {"hide_credentials": True}
    return {API_KEY_AUTH: check}


def _says_as_python(name: str) -> bool:
    """Whether `model '%ROUTE_NAME%'` is extproc's `model {name!r}` for this name."""
    return repr(name) == f"'{name}'"


def routable_names(model: RoutedModel, keys: Sequence[GatewayKey] | None) -> list[str]:
    """The names of `model` Envoy's routes may match: with `keys`, only those whose 404 Envoy can
    word as extproc does (`_says_as_python`); the others stay with extproc."""
    return [n for n in model.names if keys is None or _says_as_python(n)]
