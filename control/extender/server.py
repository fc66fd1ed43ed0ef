"""The kube-scheduler HTTP extender protocol over aiohttp: `/filter`, `/score`, health.

Wire format (k8s.io/kube-scheduler/extender/v1, Go field names, no JSON tags):
ExtenderArgs ``{"Pod", "Nodes": NodeList|null, "NodeNames": [..]|null}`` in;
ExtenderFilterResult ``{"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes",
"Error"}`` and HostPriorityList ``[{"Host", "Score"}]`` out. A request that carries
`NodeNames` (nodeCacheCapable) gets `NodeNames` back and its nodes are read from the
mirror; one that carries `Nodes` gets the passing node objects back unchanged.

A body that is not JSON, not ExtenderArgs or larger than the limit is a 400 with a message;
an unexpected error is answered as the protocol's `Error` (filter) or no scores (score),
never as a 500.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from wakegate.control.backends import BACKENDS, Backend
from wakegate.control.placement.benchdata import result_key
from wakegate.control.placement.facts import NodeFacts, PodFacts, node_facts, pod_facts
from wakegate.control.placement.rules import Weights, extender_priority, filter_node, normalise, raw_score

log = logging.getLogger("wakegate.extender")

#: default request body limit: a full NodeList of a few thousand nodes fits
DEFAULT_MAX_BODY = 32 * 1024 * 1024


class Sources(Protocol):
    def node(self, name: str) -> Mapping[str, Any] | None: ...

    def throughput(self, key: str) -> float | None: ...

    def ready(self) -> bool: ...


class BadRequest(ValueError):
    """The body is not usable ExtenderArgs; the message says why."""


@dataclass(frozen=True)
class Args:
    pod: Mapping[str, Any]
    #: candidate name -> node object (None: not known to the mirror)
    nodes: dict[str, Mapping[str, Any] | None]
    #: the request used NodeNames (nodeCacheCapable)
    by_name: bool


def parse_args(body: bytes, sources: Sources) -> Args:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest("ExtenderArgs must be a JSON object")
    pod = data.get("Pod")
    if not isinstance(pod, dict):
        raise BadRequest("ExtenderArgs.Pod must be an object")
    names = data.get("NodeNames")
    node_list = data.get("Nodes")
    if node_list is not None:
        if not isinstance(node_list, dict):
            raise BadRequest("ExtenderArgs.Nodes.items must be a list of Nodes (Nodes is not a NodeList)")
        items = node_list.get("items") or []
        if not isinstance(items, list) or not all(
            isinstance(n, dict) and isinstance(n.get("metadata"), dict) and isinstance(n["metadata"].get("name"), str)
            for n in items
        ):
            raise BadRequest("ExtenderArgs.Nodes.items must be a list of Nodes with metadata.name")
        return Args(pod, {n["metadata"]["name"]: n for n in items}, by_name=False)
    if names is None:
        return Args(pod, {}, by_name=True)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise BadRequest("ExtenderArgs.NodeNames must be a list of strings")
    return Args(pod, {n: sources.node(n) for n in names}, by_name=True)


def _facts(name: str, node: Mapping[str, Any]) -> NodeFacts:
    facts = node_facts(node)
    return facts if facts.name == name else NodeFacts(name=name)


def filter_result(args: Args, backends: Mapping[str, Backend] = BACKENDS) -> dict[str, Any]:
    pod = pod_facts(args.pod)
    passed: list[str] = []
    failed: dict[str, str] = {}
    unresolvable: dict[str, str] = {}
    for name, node in args.nodes.items():
        if node is None:
            if pod.gpu_count > 0:
                failed[name] = "node not (yet) in the wakegate extender's node cache"
            else:
                passed.append(name)
            continue
        verdict = filter_node(pod, _facts(name, node), backends)
        if verdict is None:
            passed.append(name)
        elif verdict.resolvable:
            failed[name] = verdict.message
        else:
            unresolvable[name] = verdict.message
    log.info(
        "filter %s/%s gpus=%d: passed %s, failed %s",
        pod.namespace, pod.name, pod.gpu_count, passed, {**failed, **unresolvable},
    )
    result: dict[str, Any] = {
        "FailedNodes": failed,
        "FailedAndUnresolvableNodes": unresolvable,
        "Error": "",
    }
    if args.by_name:
        result["NodeNames"] = passed
        result["Nodes"] = None
    else:
        result["NodeNames"] = None
        result["Nodes"] = {"items": [args.nodes[n] for n in passed]}
    return result


def node_throughput(pod: PodFacts, node: NodeFacts, sources: Sources) -> float:
    if pod.backend is None or pod.model is None or node.device_class is None:
        return 0.0
    return sources.throughput(result_key(pod.backend, pod.model, node.device_class)) or 0.0


def score_result(args: Args, sources: Sources, weights: Weights) -> list[dict[str, Any]]:
    pod = pod_facts(args.pod)
    raw: dict[str, float] = {}
    for name, node in args.nodes.items():
        facts = _facts(name, node) if node is not None else NodeFacts(name=name)
        raw[name] = raw_score(pod, facts, node_throughput(pod, facts, sources), weights)
    scores = normalise(raw)
    log.info("score %s/%s: raw %s -> %s", pod.namespace, pod.name,
             {n: round(v, 3) for n, v in raw.items()}, scores)
    return [{"Host": name, "Score": extender_priority(score)} for name, score in scores.items()]


def make_app(
    sources: Sources,
    weights: Weights,
    *,
    max_body: int = DEFAULT_MAX_BODY,
    backends: Mapping[str, Backend] = BACKENDS,
) -> web.Application:
    async def read_args(request: web.Request) -> Args:
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise BadRequest(f"body larger than {max_body} bytes") from None
        return parse_args(body, sources)

    def handler(
        decide: Callable[[Args], Any], what: str, on_bug: Callable[[Exception], Any]
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        """A POST handler: 400 for a request it cannot read; a bug in `decide` answers `on_bug`, never a 500."""

        async def handle(request: web.Request) -> web.Response:
            try:
                args = await read_args(request)
            except BadRequest as exc:
                log.warning("bad extender request: %s", exc)
                return web.json_response({"error": str(exc)}, status=400)
            try:
                return web.json_response(decide(args))
            except Exception as exc:
                log.exception("%s failed", what)
                return web.json_response(on_bug(exc))

        return handle

    # A rule bug must not stall scheduling: filter reports it, score gives no scores (kube-scheduler
    # then uses its own plugins' scores).
    filter_handler = handler(
        lambda args: filter_result(args, backends), "filter", lambda exc: {"Error": f"wakegate extender: {exc!r}"}
    )
    score_handler = handler(lambda args: score_result(args, sources, weights), "score", lambda _exc: [])

    async def healthz(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(_request: web.Request) -> web.Response:
        if sources.ready():
            return web.Response(text="ok")
        return web.Response(text="caches not synced", status=503)

    app = web.Application(client_max_size=max_body)
    app.router.add_post("/filter", filter_handler)
    app.router.add_post("/score", score_handler)
    app.router.add_post("/prioritize", score_handler)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app
