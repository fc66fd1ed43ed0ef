"""Generate the Kubernetes CRDs (Model, InferenceRuntime, ModelCache, ModelCatalog, LoRAAdapter, and the
federation's Cluster, FederatedModel, GlobalProxy) from control/schema.py and control/federation_schema.py.

Pydantic's JSON Schema is turned into a structural OpenAPI v3 schema as the API
server wants it: references inlined, `Optional[X]` as `nullable`, no titles,
no `additionalProperties: false` (unknown fields are pruned), key patterns of
maps as CEL rules.
`python -m wakegate.control.crd` rewrites the committed CRD files; a test keeps them in sync.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from wakegate.control.delivery_schema import ModelCacheSpec, ModelCatalogSpec
from wakegate.control.federation_schema import ClusterSpec, FederatedModelSpec, GlobalProxySpec
from wakegate.control.k8s.names import MAX_MODEL_NAME
from wakegate.control.runtime_schema import InferenceRuntimeSpec
from wakegate.control.schema import GROUP, VERSION, LoRAAdapterSpec, ModelSpec

CRD_DIR = Path(__file__).resolve().parent.parent / "charts" / "wakegate" / "crds"


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_structural(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _structural(merged, defs)
    any_of = node.get("anyOf")
    if any_of is not None:
        non_null = [branch for branch in any_of if branch.get("type") != "null"]
        if len(non_null) == 1:
            rest = {k: v for k, v in node.items() if k != "anyOf"}
            flattened: dict[str, Any] = _structural({**non_null[0], **rest}, defs)
            if len(non_null) < len(any_of):
                flattened["nullable"] = True
            return flattened
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("title", "$defs"):
            continue
        if key == "properties":
            out[key] = {name: _structural(prop, defs) for name, prop in value.items()}
        elif key == "const":
            out["enum"] = [value]
        else:
            out[key] = _structural(value, defs)
    if out.get("additionalProperties") is False:
        # Structural schemas prune unknown fields already; `false` is not allowed beside properties.
        del out["additionalProperties"]
    pattern_props = out.pop("patternProperties", None)
    if pattern_props:
        ((key_pattern, value_schema),) = pattern_props.items()
        out["additionalProperties"] = value_schema
        out.setdefault("x-kubernetes-validations", []).append(
            {"rule": f"self.all(k, k.matches({key_pattern!r}))", "message": f"keys must match {key_pattern}"}
        )
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if out.get("default") is None:
        out.pop("default", None)
    return out


def spec_schema(spec: type[BaseModel] = ModelSpec) -> dict[str, Any]:
    raw = spec.model_json_schema(mode="validation")
    schema: dict[str, Any] = _structural(raw, raw.get("$defs", {}))
    return schema


CONDITIONS_SCHEMA: dict[str, Any] = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["type", "status"],
        "properties": {
            "type": {"type": "string"},
            "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
            "reason": {"type": "string"},
            "message": {"type": "string"},
            "lastTransitionTime": {"type": "string", "format": "date-time"},
            "observedGeneration": {"type": "integer"},
        },
    },
    "x-kubernetes-list-map-keys": ["type"],
    "x-kubernetes-list-type": "map",
}

STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "x-kubernetes-preserve-unknown-fields": True,
    "properties": {
        "phase": {
            "type": "string",
            "enum": ["Idle", "Pending", "Loading", "Ready", "Failed", "Waiting", "Preempted"],
        },
        "readyReplicas": {"type": "integer"},
        "replicas": {"type": "integer"},
        "lastColdStartSeconds": {"type": "number"},
        # The idle tier: warm (replicas exist) or zero; asleep is `wakegate up`'s only (issue 34).
        "tier": {"type": "string", "enum": ["warm", "asleep", "zero"]},
        # Written by the scaler, not the operator: the GPU-group peer this Model waits for.
        "waitingFor": {"type": "string"},
        # Which path warm requests take (docs/decisions.md, "The native path"), and why not native.
        "routingPath": {"type": "string", "enum": ["native", "decided"]},
        "routingPathReason": {"type": "string"},
        # spec.source with the digest its oci:// tag named when the operator resolved it: what pods load.
        "pinnedSource": {"type": "string"},
        "observedGeneration": {"type": "integer"},
        "conditions": CONDITIONS_SCHEMA,
    },
}

#: ModelCache status. `nodes` has one entry per (node, source), keyed by both: each node's agent
#: server-side-applies only its own entries (its own field manager), so agents never overwrite
#: one another; the operator writes the summary fields and conditions.
CACHE_STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "nodes": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["node", "source", "phase"],
                "properties": {
                    "node": {"type": "string"},
                    "source": {"type": "string"},
                    "phase": {"type": "string", "enum": ["Pending", "Pulling", "Ready", "Failed"]},
                    "bytesDone": {"type": "integer"},
                    "bytesTotal": {"type": "integer"},
                    "digest": {"type": "string"},
                    "size": {"type": "integer"},
                    "file": {"type": "string"},
                    "readyTime": {"type": "string", "format": "date-time"},
                    "reason": {"type": "string"},
                    "message": {"type": "string"},
                },
            },
            "x-kubernetes-list-map-keys": ["node", "source"],
            "x-kubernetes-list-type": "map",
        },
        "readyNodes": {"type": "integer"},
        "wantedNodes": {"type": "integer"},
        "ready": {"type": "string"},
        "observedGeneration": {"type": "integer"},
        "conditions": CONDITIONS_SCHEMA,
    },
}


#: LoRAAdapter status: which replicas of the base hold the adapter, when it was last loaded, and
#: the last failure with its reason (the same fields `wakegate up` shows in /status).
ADAPTER_STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "loadedReplicas": {"type": "integer"},
        "replicas": {"type": "array", "items": {"type": "string"}},
        "ready": {"type": "string", "enum": ["True", "False"]},
        "lastLoadTime": {"type": "string", "format": "date-time"},
        "loads": {"type": "integer"},
        "failures": {"type": "integer"},
        "reason": {"type": "string"},
        "message": {"type": "string"},
        "observedGeneration": {"type": "integer"},
        "conditions": CONDITIONS_SCHEMA,
    },
}


def _crd(
    kind: str,
    scope: str,
    short_name: str,
    columns: list[dict[str, str]],
    schema: dict[str, Any],
    version_extra: dict[str, Any],
    plural: str | None = None,
) -> dict[str, Any]:
    """The CustomResourceDefinition envelope every wakegate kind shares (one served, stored version)."""
    plural = plural or f"{kind.lower()}s"
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": scope,
            "names": {
                "plural": plural,
                "singular": kind.lower(),
                "kind": kind,
                "listKind": f"{kind}List",
                "shortNames": [short_name],
                "categories": ["wakegate"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    **version_extra,
                    "additionalPrinterColumns": [
                        *columns,
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                    "schema": {"openAPIV3Schema": {"type": "object", "required": ["spec"], **schema}},
                }
            ],
        },
    }


def _properties(spec: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            **extra,
        }
    }


#: A Model's name becomes its backend Service's (wg-<name>); a FederatedModel's becomes its Models'.
NAME_RULE = {
    "rule": f"self.metadata.name.size() <= {MAX_MODEL_NAME}",
    "message": f"metadata.name must be at most {MAX_MODEL_NAME} characters (the backend Service is named wg-<name>)",
}


def model_crd() -> dict[str, Any]:
    columns = [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
        {"name": "Replicas", "type": "integer", "jsonPath": ".status.replicas"},
        {"name": "Tier", "type": "string", "jsonPath": ".status.tier"},
        {"name": "Group", "type": "string", "jsonPath": ".spec.gpu.shared"},
        {"name": "Waiting For", "type": "string", "jsonPath": ".status.waitingFor"},
        {"name": "Path", "type": "string", "jsonPath": ".status.routingPath"},
        {"name": "Reason", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].reason'},
    ]
    schema = {"x-kubernetes-validations": [NAME_RULE], **_properties(spec_schema(), status=STATUS_SCHEMA)}
    return _crd("Model", "Namespaced", "mdl", columns, schema, {"subresources": {"status": {}}})


def runtime_crd() -> dict[str, Any]:
    """InferenceRuntime: cluster-scoped and passive (no status; Models render from it)."""
    columns = [
        {"name": "Backend", "type": "string", "jsonPath": ".spec.backend"},
        {"name": "Image", "type": "string", "jsonPath": ".spec.image"},
    ]
    return _crd("InferenceRuntime", "Cluster", "irt", columns, _properties(spec_schema(InferenceRuntimeSpec)), {})


def modelcache_crd() -> dict[str, Any]:
    """ModelCache: weights kept warm in the node caches; per-node status written by the agents."""
    columns = [
        {"name": "Source", "type": "string", "jsonPath": ".spec.sources[0]"},
        {"name": "Ready", "type": "string", "jsonPath": ".status.ready"},
        {"name": "Reason", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].reason'},
    ]
    schema = _properties(spec_schema(ModelCacheSpec), status=CACHE_STATUS_SCHEMA)
    return _crd("ModelCache", "Namespaced", "mc", columns, schema, {"subresources": {"status": {}}})


#: ModelCatalog status, written by the operator after each listing of the registry.
CATALOG_STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "entries": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["repository", "tag", "digest", "size"],
                "properties": {
                    "repository": {"type": "string"},
                    "tag": {"type": "string"},
                    "digest": {"type": "string"},
                    "size": {"type": "integer"},
                    "artifactType": {"type": "string"},
                    "format": {"type": "string"},
                    "architecture": {"type": "string"},
                    "parameters": {"type": "string"},
                    "quantization": {"type": "string"},
                    "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
                },
            },
        },
        "entryCount": {"type": "integer"},
        "truncated": {"type": "integer"},
        "lastRefreshTime": {"type": "string", "format": "date-time"},
        "refreshToken": {"type": "string"},
        "observedGeneration": {"type": "integer"},
        "conditions": CONDITIONS_SCHEMA,
    },
}


def modelcatalog_crd() -> dict[str, Any]:
    """ModelCatalog: what a registry publishes, listed by the operator on an interval."""
    columns = [
        {"name": "Registry", "type": "string", "jsonPath": ".spec.registry"},
        {"name": "Entries", "type": "integer", "jsonPath": ".status.entryCount"},
        {"name": "Last Refresh", "type": "date", "jsonPath": ".status.lastRefreshTime"},
        {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
        {"name": "Reason", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].reason'},
    ]
    schema = _properties(spec_schema(ModelCatalogSpec), status=CATALOG_STATUS_SCHEMA)
    return _crd("ModelCatalog", "Namespaced", "mcat", columns, schema, {"subresources": {"status": {}}})


def loraadapter_crd() -> dict[str, Any]:
    """LoRAAdapter: an adapter of a Model, loaded into its replicas on demand."""
    columns = [
        {"name": "Base", "type": "string", "jsonPath": ".spec.baseModel"},
        {"name": "Loaded", "type": "integer", "jsonPath": ".status.loadedReplicas"},
        {"name": "Ready", "type": "string", "jsonPath": ".status.ready"},
        {"name": "Reason", "type": "string", "jsonPath": ".status.reason"},
    ]
    schema = _properties(spec_schema(LoRAAdapterSpec), status=ADAPTER_STATUS_SCHEMA)
    return _crd("LoRAAdapter", "Namespaced", "lora", columns, schema, {"subresources": {"status": {}}})


#: Cluster status, written by the federation controller from its probes of the member gateway.
CLUSTER_STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "reachable": {"type": "string", "enum": ["True", "False", "Unknown"]},
        "latencyMs": {"type": "number"},
        "lastSeen": {"type": "string", "format": "date-time"},
        "reason": {"type": "string"},
        "readyModels": {"type": "integer"},
        "models": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string"},
                    "ready": {"type": "boolean"},
                    "readyEndpoints": {"type": "integer"},
                    "queued": {"type": "integer"},
                    "inFlight": {"type": "integer"},
                },
            },
            "x-kubernetes-list-map-keys": ["name"],
            "x-kubernetes-list-type": "map",
        },
        "gpus": {
            "type": "object",
            "properties": {"total": {"type": "integer"}, "allocated": {"type": "integer"}},
        },
        "conditions": CONDITIONS_SCHEMA,
    },
}

#: FederatedModel status: one entry per placed cluster, and a one-word-per-cluster summary for kubectl.
FEDERATED_STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "clusters": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["cluster"],
                "properties": {
                    "cluster": {"type": "string"},
                    "phase": {"type": "string"},
                    "ready": {"type": "boolean"},
                    "readyReplicas": {"type": "integer"},
                    "reachable": {"type": "boolean"},
                    "reason": {"type": "string"},
                },
            },
            "x-kubernetes-list-map-keys": ["cluster"],
            "x-kubernetes-list-type": "map",
        },
        "placed": {"type": "integer"},
        "readyClusters": {"type": "integer"},
        "summary": {"type": "string"},
        "observedGeneration": {"type": "integer"},
        "conditions": CONDITIONS_SCHEMA,
    },
}

#: GlobalProxy status, written by the global gateway: its members as it sees them.
PROXY_STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "members": {"type": "integer"},
        "healthyMembers": {"type": "integer"},
        "observedGeneration": {"type": "integer"},
        "conditions": CONDITIONS_SCHEMA,
    },
}


def cluster_crd() -> dict[str, Any]:
    """Cluster: a member cluster of the federation (cluster-scoped), probed through its gateway."""
    columns = [
        {"name": "Region", "type": "string", "jsonPath": ".spec.region"},
        {"name": "Reachable", "type": "string", "jsonPath": ".status.reachable"},
        {"name": "Latency(ms)", "type": "number", "jsonPath": ".status.latencyMs"},
        {"name": "Ready Models", "type": "integer", "jsonPath": ".status.readyModels"},
        {"name": "Last Seen", "type": "date", "jsonPath": ".status.lastSeen"},
    ]
    schema = _properties(spec_schema(ClusterSpec), status=CLUSTER_STATUS_SCHEMA)
    return _crd("Cluster", "Cluster", "wgc", columns, schema, {"subresources": {"status": {}}})


def federatedmodel_crd() -> dict[str, Any]:
    """FederatedModel: a Model template placed in member clusters; per-cluster status."""
    columns = [
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyClusters"},
        {"name": "Placed", "type": "integer", "jsonPath": ".status.placed"},
        {"name": "Clusters", "type": "string", "jsonPath": ".status.summary"},
        {"name": "Mode", "type": "string", "jsonPath": ".spec.placement.mode"},
    ]
    schema = {
        "x-kubernetes-validations": [NAME_RULE],
        **_properties(spec_schema(FederatedModelSpec), status=FEDERATED_STATUS_SCHEMA),
    }
    return _crd("FederatedModel", "Namespaced", "fdm", columns, schema, {"subresources": {"status": {}}})


def globalproxy_crd() -> dict[str, Any]:
    """GlobalProxy: the global gateway's settings."""
    columns = [
        {"name": "Port", "type": "integer", "jsonPath": ".spec.listeners[0].port"},
        {"name": "Healthy", "type": "integer", "jsonPath": ".status.healthyMembers"},
        {"name": "Members", "type": "integer", "jsonPath": ".status.members"},
    ]
    schema = _properties(spec_schema(GlobalProxySpec), status=PROXY_STATUS_SCHEMA)
    return _crd(
        "GlobalProxy", "Namespaced", "gpx", columns, schema, {"subresources": {"status": {}}}, plural="globalproxies"
    )


def render() -> dict[str, str]:
    """File name -> YAML text for every CRD we ship."""
    header = "# Generated by `python -m wakegate.control.crd` from control/schema.py; do not edit.\n"
    return {
        f"{name}.{GROUP}.yaml": header + yaml.safe_dump(crd(), sort_keys=False, width=120)
        for name, crd in (
            ("models", model_crd),
            ("inferenceruntimes", runtime_crd),
            ("modelcaches", modelcache_crd),
            ("modelcatalogs", modelcatalog_crd),
            ("loraadapters", loraadapter_crd),
            ("clusters", cluster_crd),
            ("federatedmodels", federatedmodel_crd),
            ("globalproxies", globalproxy_crd),
        )
    }


def main() -> int:
    CRD_DIR.mkdir(parents=True, exist_ok=True)
    for name, text in render().items():
        (CRD_DIR / name).write_text(text, encoding="utf-8")
        print(f"wrote {CRD_DIR / name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
