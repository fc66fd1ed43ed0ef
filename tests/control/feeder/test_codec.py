"""The `up` → feeder wire: typed round trips of every field, frames of any size, deltas."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import struct
import typing
from pathlib import Path
from typing import Any

import pytest

from wakegate.control.feeder import codec
from wakegate.control.feeder.routed import RoutedAdapter, RoutedFlow, RoutedModel, UpstreamTls
from wakegate.control.feeder.settings import GatewaySettings
from wakegate.control.up.feeder import RoutedSource, decode, delta_message, gateway_from_json, gateway_json

TLS = UpstreamTls(
    name="east", ca_file="/ca.pem", server_name="east.example", ip_san="10.0.0.1", cert_file="/c", key_file="/k"
)
ADAPTER = RoutedAdapter(
    name="sql",
    names=("sql", "tiny-sql"),
    served_name="sql-v1",
    lora_id=2,
    scale=0.5,
    endpoints=("127.0.0.1:9000",),
    failed_loads=3,
    last_failure="refused",
)


def every_field_set() -> RoutedModel:
    """A model whose every field differs from its default, nested ones too."""
    return RoutedModel(
        key="ns/chat",
        names=("chat", "c"),
        served_name="org/chat-1b",
        lora_adapters=("fr", "de"),
        adapters=(ADAPTER,),
        adapters_on_demand=True,
        adapter_placement="random",
        strategy="least-loaded",
        profile="precise",
        weights=(("prefix", 3.0), ("queue", 1.5)),
        kv_events_offset=1,
        kv_events_replay_offset=2,
        requests_per_second=2.5,
        burst=4.0,
        cold_mode="keepalive",
        max_queue=7,
        activation_timeout_s=12.5,
        endpoints=(("127.0.0.1", 9000), ("127.0.0.2", 9001)),
        generation=9,
        failed_activations=2,
        last_failure="exit 1",
        failure_code="weights_unavailable",
        admitted=False,
        loads=(("127.0.0.1", 9000, 4),),
        fallback_endpoints=1,
        endpoint_weights=(("127.0.0.1", 9000, 3),),
        endpoint_tls=(("127.0.0.2", 9001, TLS),),
        endpoint_authorization=(("127.0.0.2", 9001, "Bearer t"),),
        path="native",
        tokenizer="/models/tiny",
        flow=RoutedFlow(band="critical", max_queue=9, queue_timeout_s=2.5, max_waiting=3, max_kv_usage=0.5,
                        max_in_flight=7),
    )


def differs_from_defaults(value: Any) -> list[str]:
    """Names of fields (nested too) still at their defaults: the fixture must leave none."""
    same = []
    for f in dataclasses.fields(value):
        got = getattr(value, f.name)
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        if got == default:
            same.append(f.name)
    return same


def over_json(message: dict[str, Any]) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(json.dumps(message))
    return loaded


def test_every_field_of_a_model_round_trips_with_its_types() -> None:
    model = every_field_set()
    assert differs_from_defaults(model) == []
    assert differs_from_defaults(ADAPTER) == [] and differs_from_defaults(TLS) == []
    again = codec.from_wire(RoutedModel, over_json(codec.to_wire(model)))
    assert again == model
    # Types, not just values: tuples stay tuples (hashable, so the feeder can key on them).
    assert isinstance(again.endpoints[0], tuple) and isinstance(again.adapters[0], RoutedAdapter)
    assert isinstance(again.endpoint_tls[0][2], UpstreamTls) and isinstance(again.weights, tuple)
    assert hash(again) == hash(model)


def test_every_gateway_setting_round_trips() -> None:
    settings = GatewaySettings(
        listen_host="0.0.0.0",
        listen_port=9090,
        max_request_bytes=1,
        max_hold_seconds=2,
        extproc_message_timeout_ms=3,
        stream_idle_timeout_s=4,
        upstream_connect_timeout_ms=5,
        upstream_max_connections=6,
        upstream_header=True,
        extra_listener_filters=({"name": "x", "typed_config": {"a": [1, 2]}},),
        access_log_clusters=("a", "b", "c"),
        upstream_retries=7,
        upstream_retry_on="reset",
        native_allowed=True,
        key_checks=True,
        global_rate_limit=True,
        global_rps=0.5,
        global_burst=3.0,
        replay=True,
    )
    assert differs_from_defaults(settings) == []
    assert gateway_from_json(gateway_json(settings)) == settings


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"max_queue": "7"}, "RoutedModel.max_queue: expected int, got str"),
        ({"endpoints": [["127.0.0.1"]]}, r"RoutedModel.endpoints\[0\]: expected 2 items, got 1"),
        ({"adapters": [{"name": "a", "color": "red"}]}, r"RoutedModel.adapters\[0\]: unknown field\(s\) color"),
        ({"admitted": 1}, "RoutedModel.admitted: expected bool, got int"),
        ({"names": "chat"}, "RoutedModel.names: expected a list, got str"),
    ],
)
def test_a_field_of_the_wrong_shape_is_an_error_naming_it(change: dict[str, Any], message: str) -> None:
    wire = {**codec.to_wire(every_field_set()), **change}
    with pytest.raises(ValueError, match=message):
        codec.from_wire(RoutedModel, wire)


def test_the_codec_knows_every_field_type_the_wire_classes_use() -> None:
    # A field added later with a type the codec has no rule for fails here, not at run time.
    for cls in (RoutedModel, RoutedAdapter, UpstreamTls, GatewaySettings):
        for name, hint in typing.get_type_hints(cls).items():
            default = next(f for f in dataclasses.fields(cls) if f.name == name)
            value = default.default_factory() if default.default_factory is not dataclasses.MISSING else default.default
            if value is dataclasses.MISSING:
                continue
            assert codec._decode(hint, over_json({"v": codec.to_wire(value)})["v"], name) == value


async def frames_through_a_pipe(*messages: dict[str, Any]) -> list[dict[str, Any] | None]:
    reader = asyncio.StreamReader()
    for message in messages:
        reader.feed_data(codec.frame(message))
    reader.feed_eof()
    out: list[dict[str, Any] | None] = []
    while True:
        message = await codec.read_frame(reader)
        out.append(message)
        if message is None:
            return out


async def test_a_message_larger_than_a_mebibyte_crosses_in_one_frame() -> None:
    # 3,000 models of every field: several MiB, far past the old 64 KiB line limit.
    models = [dataclasses.replace(every_field_set(), key=f"ns/m{i}", names=(f"m{i}",)) for i in range(3000)]
    message = delta_message(models, ["ns/gone"])
    assert len(codec.frame(message)) > 1 << 20
    received = await frames_through_a_pipe(message, {"refused": {"ads": 1}})
    assert received[-1] is None
    update = decode(received[0] or {})
    assert update.upserted == tuple(models) and update.removed == ("ns/gone",) and not update.whole
    assert received[1] == {"refused": {"ads": 1}}


async def test_frames_refuse_a_corrupt_length_a_non_object_and_a_cut() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(struct.pack(">I", codec.MAX_FRAME + 1))
    with pytest.raises(codec.FrameError, match="at most"):
        await codec.read_frame(reader)

    reader = asyncio.StreamReader()
    reader.feed_data(struct.pack(">I", 2) + b"[]")
    with pytest.raises(codec.FrameError, match="list, not an object"):
        await codec.read_frame(reader)

    reader = asyncio.StreamReader()
    reader.feed_data(codec.frame({"a": 1})[:-1])
    reader.feed_eof()
    with pytest.raises(asyncio.IncompleteReadError):
        await codec.read_frame(reader)


async def test_up_sends_the_whole_state_once_then_only_what_changed(tmp_path: Path) -> None:
    fleet = {f"ns/m{i}": RoutedModel(key=f"ns/m{i}", names=(f"m{i}",), served_name=f"m{i}") for i in range(500)}
    asked: list[str] = []

    def one(key: str) -> RoutedModel | None:
        asked.append(key)
        return fleet.get(key)

    source = RoutedSource(tmp_path / "feeder.sock", lambda: list(fleet.values()), one)
    await source.start()
    reader, writer = await asyncio.open_unix_connection(str(tmp_path / "feeder.sock"))
    try:
        first = decode(await codec.read_frame(reader) or {})
        assert first.whole and len(first.upserted) == 500 and first.baseline is None

        # One replica ready: one model in the next frame, and only that model was asked for.
        fleet["ns/m7"] = dataclasses.replace(fleet["ns/m7"], endpoints=(("127.0.0.1", 9000),))
        source.publish_soon("ns/m7")
        source.publish_soon("ns/m8")  # said to have changed, but equal to what was sent: not sent
        update = decode(await asyncio.wait_for(codec.read_frame(reader), 5) or {})
        assert [m.key for m in update.upserted] == ["ns/m7"] and update.removed == ()
        assert sorted(asked) == ["ns/m7", "ns/m8"]

        del fleet["ns/m9"]
        source.publish_soon("ns/m9")
        update = decode(await asyncio.wait_for(codec.read_frame(reader), 5) or {})
        assert update.upserted == () and update.removed == ("ns/m9",)

        # The feeder's refused-call counts come back as frames.
        writer.write(codec.frame({"refused": {"ads": 2}}))
        for _ in range(100):
            if source.refused:
                break
            await asyncio.sleep(0.01)
        assert source.refused == {"ads": 2}

        # A second feeder (a restart) gets the whole state and, as baseline, what the first had.
        fleet["ns/m1"] = dataclasses.replace(fleet["ns/m1"], generation=2)
        source.publish_soon("ns/m1")
        reader2, writer2 = await asyncio.open_unix_connection(str(tmp_path / "feeder.sock"))
        again = decode(await asyncio.wait_for(codec.read_frame(reader2), 5) or {})
        assert again.whole and len(again.upserted) == 499 and again.baseline is not None
        assert {m.key: m for m in again.upserted} == fleet
        # The first feeder got the change before the second connected: both hold one state.
        update = decode(await asyncio.wait_for(codec.read_frame(reader), 5) or {})
        assert [m.generation for m in update.upserted] == [2]
        writer2.close()
    finally:
        writer.close()
        await source.close()
