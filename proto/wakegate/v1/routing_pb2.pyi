from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Strategy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STRATEGY_DEFAULT: _ClassVar[Strategy]
    STRATEGY_SESSION_AFFINITY: _ClassVar[Strategy]
    STRATEGY_PREFIX: _ClassVar[Strategy]
    STRATEGY_LEAST_LOADED: _ClassVar[Strategy]
    STRATEGY_ROUND_ROBIN: _ClassVar[Strategy]

class ColdMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COLD_MODE_HOLD: _ClassVar[ColdMode]
    COLD_MODE_KEEPALIVE: _ClassVar[ColdMode]
    COLD_MODE_REJECT: _ClassVar[ColdMode]
STRATEGY_DEFAULT: Strategy
STRATEGY_SESSION_AFFINITY: Strategy
STRATEGY_PREFIX: Strategy
STRATEGY_LEAST_LOADED: Strategy
STRATEGY_ROUND_ROBIN: Strategy
COLD_MODE_HOLD: ColdMode
COLD_MODE_KEEPALIVE: ColdMode
COLD_MODE_REJECT: ColdMode

class Endpoint(_message.Message):
    __slots__ = ("address", "port", "engine_load", "weight")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_LOAD_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    address: str
    port: int
    engine_load: int
    weight: int
    def __init__(self, address: _Optional[str] = ..., port: _Optional[int] = ..., engine_load: _Optional[int] = ..., weight: _Optional[int] = ...) -> None: ...

class RateLimit(_message.Message):
    __slots__ = ("requests_per_second", "burst", "counted_by_envoy", "global_counted_by_envoy")
    REQUESTS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    BURST_FIELD_NUMBER: _ClassVar[int]
    COUNTED_BY_ENVOY_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_COUNTED_BY_ENVOY_FIELD_NUMBER: _ClassVar[int]
    requests_per_second: float
    burst: float
    counted_by_envoy: bool
    global_counted_by_envoy: bool
    def __init__(self, requests_per_second: _Optional[float] = ..., burst: _Optional[float] = ..., counted_by_envoy: _Optional[bool] = ..., global_counted_by_envoy: _Optional[bool] = ...) -> None: ...

class ColdPolicy(_message.Message):
    __slots__ = ("mode", "max_queue", "activation_timeout_ms")
    MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    mode: ColdMode
    max_queue: int
    activation_timeout_ms: int
    def __init__(self, mode: _Optional[_Union[ColdMode, str]] = ..., max_queue: _Optional[int] = ..., activation_timeout_ms: _Optional[int] = ...) -> None: ...

class LoRAAdapterRoute(_message.Message):
    __slots__ = ("name", "names", "served_name", "lora_id", "scale", "endpoints", "failed_loads", "last_failure")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    SERVED_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    FAILED_LOADS_FIELD_NUMBER: _ClassVar[int]
    LAST_FAILURE_FIELD_NUMBER: _ClassVar[int]
    name: str
    names: _containers.RepeatedScalarFieldContainer[str]
    served_name: str
    lora_id: int
    scale: float
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    failed_loads: int
    last_failure: str
    def __init__(self, name: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ..., served_name: _Optional[str] = ..., lora_id: _Optional[int] = ..., scale: _Optional[float] = ..., endpoints: _Optional[_Iterable[str]] = ..., failed_loads: _Optional[int] = ..., last_failure: _Optional[str] = ...) -> None: ...

class FlowControl(_message.Message):
    __slots__ = ("enabled", "band", "max_queue", "queue_timeout_ms", "max_waiting", "max_kv_usage", "max_in_flight")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    BAND_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_FIELD_NUMBER: _ClassVar[int]
    MAX_KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    band: str
    max_queue: int
    queue_timeout_ms: int
    max_waiting: int
    max_kv_usage: float
    max_in_flight: int
    def __init__(self, enabled: _Optional[bool] = ..., band: _Optional[str] = ..., max_queue: _Optional[int] = ..., queue_timeout_ms: _Optional[int] = ..., max_waiting: _Optional[int] = ..., max_kv_usage: _Optional[float] = ..., max_in_flight: _Optional[int] = ...) -> None: ...

class ModelRoute(_message.Message):
    __slots__ = ("key", "names", "served_name", "lora_adapters", "cluster", "strategy", "rate_limit", "endpoints", "cold", "generation", "failed_activations", "last_failure", "admitted", "profile", "weights", "failure_code", "kv_events_offset", "kv_events_replay_offset", "adapters", "adapters_on_demand", "adapter_placement", "fallback_endpoints", "path", "flow", "tokenizer")
    class WeightsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    KEY_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    SERVED_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    RATE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    COLD_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    FAILED_ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    LAST_FAILURE_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_CODE_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_OFFSET_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_REPLAY_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_ON_DEMAND_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    FLOW_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    key: str
    names: _containers.RepeatedScalarFieldContainer[str]
    served_name: str
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    cluster: str
    strategy: Strategy
    rate_limit: RateLimit
    endpoints: _containers.RepeatedCompositeFieldContainer[Endpoint]
    cold: ColdPolicy
    generation: int
    failed_activations: int
    last_failure: str
    admitted: bool
    profile: str
    weights: _containers.ScalarMap[str, float]
    failure_code: str
    kv_events_offset: int
    kv_events_replay_offset: int
    adapters: _containers.RepeatedCompositeFieldContainer[LoRAAdapterRoute]
    adapters_on_demand: bool
    adapter_placement: str
    fallback_endpoints: int
    path: str
    flow: FlowControl
    tokenizer: str
    def __init__(self, key: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ..., served_name: _Optional[str] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., cluster: _Optional[str] = ..., strategy: _Optional[_Union[Strategy, str]] = ..., rate_limit: _Optional[_Union[RateLimit, _Mapping]] = ..., endpoints: _Optional[_Iterable[_Union[Endpoint, _Mapping]]] = ..., cold: _Optional[_Union[ColdPolicy, _Mapping]] = ..., generation: _Optional[int] = ..., failed_activations: _Optional[int] = ..., last_failure: _Optional[str] = ..., admitted: _Optional[bool] = ..., profile: _Optional[str] = ..., weights: _Optional[_Mapping[str, float]] = ..., failure_code: _Optional[str] = ..., kv_events_offset: _Optional[int] = ..., kv_events_replay_offset: _Optional[int] = ..., adapters: _Optional[_Iterable[_Union[LoRAAdapterRoute, _Mapping]]] = ..., adapters_on_demand: _Optional[bool] = ..., adapter_placement: _Optional[str] = ..., fallback_endpoints: _Optional[int] = ..., path: _Optional[str] = ..., flow: _Optional[_Union[FlowControl, _Mapping]] = ..., tokenizer: _Optional[str] = ...) -> None: ...
