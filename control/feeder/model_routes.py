"""extproc's route of a model (`ModelRoute`): what extproc needs to hold, pick and admit its requests."""

from __future__ import annotations

from wakegate import contract
from wakegate.control.feeder.routed import RoutedFlow, RoutedModel
from wakegate.v1 import routing_pb2


def model_route(
    model: RoutedModel, counted_by_envoy: bool = False, global_counted: bool = False
) -> routing_pb2.ModelRoute:
    """extproc's route of `model`; `counted_by_envoy`: Envoy keeps its bucket (envoy_rate_limited),
    and with `global_counted` the gateway-wide one for the same requests.

    An adapter's holders are only those among the route's endpoints: a gateway whose Envoy has
    not confirmed an endpoint yet (`for_gateway`) sees neither the endpoint nor it as a holder."""
    routable = {f"{ip}:{port}" for ip, port in model.endpoints}
    return routing_pb2.ModelRoute(
        key=model.key,
        names=list(model.names),
        served_name=model.served_name,
        lora_adapters=list(model.lora_adapters),
        adapters=[
            routing_pb2.LoRAAdapterRoute(
                name=a.name,
                names=list(a.names),
                served_name=a.served_name,
                lora_id=a.lora_id if a.lora_id >= 0 else None,
                scale=a.scale,
                endpoints=[e for e in a.endpoints if e in routable],
                failed_loads=a.failed_loads,
                last_failure=a.last_failure,
            )
            for a in model.adapters
        ],
        adapters_on_demand=model.adapters_on_demand,
        adapter_placement=model.adapter_placement if model.adapters_on_demand else "",
        cluster=model.cluster,
        strategy=contract.STRATEGIES[model.strategy],
        profile=model.profile,
        weights=dict(model.weights),
        kv_events_offset=model.kv_events_offset,
        kv_events_replay_offset=model.kv_events_replay_offset,
        tokenizer=model.tokenizer,
        fallback_endpoints=model.fallback_endpoints,
        rate_limit=routing_pb2.RateLimit(
            requests_per_second=model.requests_per_second,
            burst=model.burst,
            counted_by_envoy=counted_by_envoy,
            global_counted_by_envoy=counted_by_envoy and global_counted,
        ),
        endpoints=_route_endpoints(model),
        cold=routing_pb2.ColdPolicy(
            mode=contract.COLD_MODES[model.cold_mode],
            max_queue=model.max_queue,
            activation_timeout_ms=int(model.activation_timeout_s * 1000),
        ),
        generation=model.generation,
        failed_activations=model.failed_activations,
        last_failure=model.last_failure,
        failure_code=model.failure_code,
        admitted=model.admitted,
        path=model.path,
        flow=_flow(model.flow),
    )


def _flow(flow: RoutedFlow | None) -> routing_pb2.FlowControl | None:
    if flow is None:
        return None
    return routing_pb2.FlowControl(
        enabled=True,
        band=flow.band,
        max_queue=flow.max_queue,
        queue_timeout_ms=int(flow.queue_timeout_s * 1000),
        max_waiting=flow.max_waiting,
        max_kv_usage=flow.max_kv_usage,
        max_in_flight=flow.max_in_flight,
    )


def _route_endpoints(model: RoutedModel) -> list[routing_pb2.Endpoint]:
    loads = {(ip, port): queue for ip, port, queue in model.loads}
    weights = {(ip, port): weight for ip, port, weight in model.endpoint_weights}
    return [
        routing_pb2.Endpoint(
            address=ip, port=port, engine_load=loads.get((ip, port), 0), weight=weights.get((ip, port), 0)
        )
        for ip, port in sorted(model.endpoints)
    ]
