from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelDemand(_message.Message):
    __slots__ = ("model", "queued", "in_flight", "leases", "failures_seen", "adapters")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    FAILURES_SEEN_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    queued: int
    in_flight: int
    leases: int
    failures_seen: int
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterDemand]
    def __init__(self, model: _Optional[str] = ..., queued: _Optional[int] = ..., in_flight: _Optional[int] = ..., leases: _Optional[int] = ..., failures_seen: _Optional[int] = ..., adapters: _Optional[_Iterable[_Union[AdapterDemand, _Mapping]]] = ...) -> None: ...

class AdapterDemand(_message.Message):
    __slots__ = ("adapter", "queued", "uses")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    USES_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    queued: int
    uses: _containers.RepeatedCompositeFieldContainer[AdapterUse]
    def __init__(self, adapter: _Optional[str] = ..., queued: _Optional[int] = ..., uses: _Optional[_Iterable[_Union[AdapterUse, _Mapping]]] = ...) -> None: ...

class AdapterUse(_message.Message):
    __slots__ = ("endpoint", "queued", "in_flight", "routed")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ROUTED_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    queued: int
    in_flight: int
    routed: int
    def __init__(self, endpoint: _Optional[str] = ..., queued: _Optional[int] = ..., in_flight: _Optional[int] = ..., routed: _Optional[int] = ...) -> None: ...

class DemandReport(_message.Message):
    __slots__ = ("gateway_id", "instance", "sequence", "models", "withdraw")
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    WITHDRAW_FIELD_NUMBER: _ClassVar[int]
    gateway_id: str
    instance: str
    sequence: int
    models: _containers.RepeatedCompositeFieldContainer[ModelDemand]
    withdraw: bool
    def __init__(self, gateway_id: _Optional[str] = ..., instance: _Optional[str] = ..., sequence: _Optional[int] = ..., models: _Optional[_Iterable[_Union[ModelDemand, _Mapping]]] = ..., withdraw: _Optional[bool] = ...) -> None: ...

class ReportReply(_message.Message):
    __slots__ = ("accepted", "reason")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...
