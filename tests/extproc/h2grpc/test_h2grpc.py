"""extproc's HTTP/2 gRPC server against a real gRPC client (grpcio) and raw HTTP/2 frames.

grpcio's client is a strict, independent HTTP/2 and gRPC implementation: if it gets its
answers, with the right statuses, through its own flow control, the server speaks the
protocol. Raw frames cover what no well-behaved client sends.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from wakegate.extproc.h2grpc import call as grpc_call
from wakegate.extproc.h2grpc.call import Call, GrpcError, GrpcServer, unary
from wakegate.extproc.h2grpc.frames import (
    ACK,
    CANCEL,
    CONTINUATION,
    DATA,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    MAX_WINDOW,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    WINDOW_UPDATE,
)
from wakegate.extproc.h2grpc.limits import H2Limits

ECHO = "/wakegate.test.Echo/Chat"
UPPER = "/wakegate.test.Echo/Upper"
BOOM = "/wakegate.test.Echo/Boom"
SLOW = "/wakegate.test.Echo/Slow"


class EchoCall:
    """Echoes each message; on half-close answers with the count and status OK."""

    def __init__(self, call: Call, log: list[str]) -> None:
        self.call = call
        self.count = 0
        self.log = log

    def on_message(self, data: bytes) -> None:
        self.count += 1
        if data == b"fail":
            self.call.finish(grpc_call.INVALID_ARGUMENT, "no f\u00fcn allowed: 100%")
            return
        self.call.send(data)

    def on_half_close(self) -> None:
        self.call.send(str(self.count).encode())
        self.call.finish()
        self.log.append("half-close")

    def on_cancel(self) -> None:
        self.log.append("cancel")


class SlowCall:
    """Answers each message 0.2 s later, from a task (as a held cold request does)."""

    def __init__(self, call: Call, log: list[str]) -> None:
        self.call = call
        self.log = log
        self.task: asyncio.Task[None] | None = None

    def on_message(self, data: bytes) -> None:
        async def later() -> None:
            await asyncio.sleep(0.2)
            self.call.send(data)
            self.call.finish()
            self.log.append("slow-done")

        self.task = asyncio.get_running_loop().create_task(later())

    def on_half_close(self) -> None:
        pass

    def on_cancel(self) -> None:
        self.log.append("cancel")
        if self.task is not None:
            self.task.cancel()


class Boom:
    def __init__(self, call: Call) -> None:
        self.call = call

    def on_message(self, data: bytes) -> None:
        raise RuntimeError("listener bug")

    def on_half_close(self) -> None:
        pass

    def on_cancel(self) -> None:
        pass


def upper(data: bytes) -> bytes:
    if not data:
        raise GrpcError(grpc_call.INVALID_ARGUMENT, "empty")
    return data.upper()


def health(data: bytes) -> bytes:
    request = health_pb2.HealthCheckRequest.FromString(data)
    if request.service:
        raise GrpcError(grpc_call.NOT_FOUND, "unknown service")
    return bytes(health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING).SerializeToString())


@pytest.fixture
async def served():
    log: list[str] = []
    server = GrpcServer(
        {
            ECHO: lambda call: EchoCall(call, log),
            SLOW: lambda call: SlowCall(call, log),
            UPPER: unary(upper),
            BOOM: Boom,
            "/grpc.health.v1.Health/Check": unary(health),
        },
        max_message_bytes=8 * 1024 * 1024,
    )
    address = await server.listen("127.0.0.1:0")
    channel = grpc.aio.insecure_channel(
        address,
        options=[("grpc.max_receive_message_length", 16 * 1024 * 1024), ("grpc.max_send_message_length", 16 << 20)],
    )
    yield server, channel, address, log
    await channel.close()
    await server.stop(1.0)


async def test_unary_and_health_check_from_grpcio(served) -> None:
    _, channel, _, _ = served
    assert await channel.unary_unary(UPPER)(b"hello") == b"HELLO"
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Check(health_pb2.HealthCheckRequest(service="nope"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_unary_handler_error_reaches_the_client(served) -> None:
    _, channel, _, _ = served
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await channel.unary_unary(UPPER)(b"")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "empty"


async def test_bidi_stream_keeps_order_and_ends_with_ok(served) -> None:
    _, channel, _, log = served
    call = channel.stream_stream(ECHO)()
    for i in range(200):
        await call.write(f"m{i}".encode())
        assert await call.read() == f"m{i}".encode()
    await call.done_writing()
    assert await call.read() == b"200"
    assert await call.code() == grpc.StatusCode.OK
    assert log == ["half-close"]


async def test_large_messages_both_ways_respect_flow_control(served) -> None:
    # 6 MB each way: far past grpcio's initial 64 KiB windows and our peer's frame size,
    # so the server must split frames and wait for WINDOW_UPDATEs.
    _, channel, _, _ = served
    payload = bytes(range(256)) * (6 * 1024 * 4)
    call = channel.stream_stream(ECHO)()
    await call.write(payload)
    assert await call.read() == payload
    await call.write(b"x" * 100_000)
    assert await call.read() == b"x" * 100_000
    await call.done_writing()
    assert await call.read() == b"2"
    assert await call.code() == grpc.StatusCode.OK


async def test_many_concurrent_calls_on_one_connection(served) -> None:
    _, channel, _, _ = served
    method = channel.unary_unary(UPPER)
    replies = await asyncio.gather(*(method(f"call-{i}".encode()) for i in range(500)))
    assert replies == [f"CALL-{i}".upper().encode() for i in range(500)]


async def test_status_message_is_percent_encoded(served) -> None:
    _, channel, _, _ = served
    call = channel.stream_stream(ECHO)()
    await call.write(b"fail")
    assert await call.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await call.details() == "no f\u00fcn allowed: 100%"


async def test_unknown_method_is_unimplemented(served) -> None:
    _, channel, _, _ = served
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await channel.unary_unary("/wakegate.test.Echo/Missing")(b"x")
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_message_over_the_limit_is_refused(served) -> None:
    _, channel, _, log = served
    call = channel.stream_stream(ECHO)()
    await call.write(b"y" * (8 * 1024 * 1024 + 1))
    assert await call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert log == ["cancel"]  # the listener hears that its call is over
    # ... and the connection still serves other calls
    assert await channel.unary_unary(UPPER)(b"ok") == b"OK"


async def test_listener_exception_is_internal_and_server_keeps_serving(served, caplog) -> None:
    _, channel, _, _ = served
    call = channel.stream_stream(BOOM)()
    await call.write(b"x")
    assert await call.code() == grpc.StatusCode.INTERNAL
    assert "listener bug" in caplog.text
    assert await channel.unary_unary(UPPER)(b"still") == b"STILL"


async def test_client_cancel_reaches_the_listener(served) -> None:
    server, channel, _, log = served
    call = channel.stream_stream(SLOW)()
    await call.write(b"x")
    await asyncio.sleep(0.05)
    call.cancel()
    for _ in range(100):
        if log:
            break
        await asyncio.sleep(0.01)
    assert log == ["cancel"]
    await asyncio.sleep(0.3)
    assert "slow-done" not in log
    assert server.active_calls == 0


async def test_stop_lets_open_calls_finish_and_refuses_new_ones(served) -> None:
    server, channel, address, log = served
    call = channel.stream_stream(SLOW)()
    await call.write(b"in flight")
    await asyncio.sleep(0.05)
    stopping = asyncio.create_task(server.stop(5.0))
    assert await call.read() == b"in flight"
    assert await call.code() == grpc.StatusCode.OK
    await stopping
    assert log == ["slow-done"]
    async with grpc.aio.insecure_channel(address) as fresh:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fresh.unary_unary(UPPER)(b"late", timeout=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_unix_socket(tmp_path) -> None:
    server = GrpcServer({UPPER: unary(upper)})
    path = tmp_path / "s.sock"
    await server.listen(f"unix:{path}")
    async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
        assert await channel.unary_unary(UPPER)(b"uds") == b"UDS"
    await server.stop(1.0)


# -- raw frames ------------------------------------------------------------------------------


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream_id) + payload


def _read_frames(
    sock: socket.socket, until_kind: int, timeout: float = 3.0, until_flags: int = 0
) -> list[tuple[int, int, int, bytes]]:
    """Frames until one of `until_kind` (with all of `until_flags`), EOF or the timeout."""
    sock.settimeout(timeout)
    data = b""
    frames: list[tuple[int, int, int, bytes]] = []
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return frames
        if not chunk:
            return frames
        data += chunk
        while len(data) >= 9:
            length = int.from_bytes(data[:3], "big")
            if len(data) < 9 + length:
                break
            frame = (data[3], data[4], int.from_bytes(data[5:9], "big"), data[9 : 9 + length])
            frames.append(frame)
            data = data[9 + length :]
            if frame[0] == until_kind and frame[1] & until_flags == until_flags:
                return frames


def _raw(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)))


@pytest.mark.parametrize(
    ("opening", "code"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", PROTOCOL_ERROR),
        (PREFACE + _frame(SETTINGS, 0, 0, b"\x00\x04\x00"), FRAME_SIZE_ERROR),
        (PREFACE + b"\x20\x00\x00" + bytes((0, 0)) + b"\x00\x00\x00\x01", FRAME_SIZE_ERROR),
        (PREFACE + _frame(HEADERS, END_HEADERS, 2, b"\x83"), PROTOCOL_ERROR),
        (PREFACE + _frame(HEADERS, END_HEADERS, 1, b"\xff\xff\xff\xff\x0f"), 9),
        (PREFACE + _frame(DATA, 0, 7, b"\x00"), PROTOCOL_ERROR),
        (PREFACE + _frame(WINDOW_UPDATE, 0, 0, b"\x00\x00\x00\x00"), PROTOCOL_ERROR),
        (PREFACE + _frame(PUSH_PROMISE, 0, 1, b"\x00\x00\x00\x02"), PROTOCOL_ERROR),
    ],
    ids=["http1", "short-settings", "huge-frame", "even-stream", "bad-hpack", "data-idle", "window-0", "push"],
)
async def test_protocol_errors_end_only_that_connection(served, opening: bytes, code: int) -> None:
    _, channel, address, _ = served
    loop = asyncio.get_running_loop()

    def exchange() -> list[tuple[int, int, int, bytes]]:
        with _raw(address) as sock:
            sock.sendall(opening)
            return _read_frames(sock, GOAWAY)

    frames = await loop.run_in_executor(None, exchange)
    goaway = [f for f in frames if f[0] == GOAWAY]
    assert goaway, frames
    assert struct.unpack(">I", goaway[-1][3][4:8])[0] == code
    assert await channel.unary_unary(UPPER)(b"fine") == b"FINE"


async def test_ping_is_answered(served) -> None:
    _, _, address, _ = served

    def exchange() -> list[tuple[int, int, int, bytes]]:
        with _raw(address) as sock:
            sock.sendall(PREFACE + _frame(SETTINGS, 0, 0) + _frame(PING, 0, 0, b"12345678"))
            return _read_frames(sock, PING)

    frames = await asyncio.get_running_loop().run_in_executor(None, exchange)
    assert frames[-1] == (PING, ACK, 0, b"12345678")


async def test_continuation_and_padding_are_understood(served) -> None:
    """What grpcio never sends: a header block split over CONTINUATION, padded DATA."""
    import hpack

    _, _, address, _ = served
    block = hpack.Encoder().encode(
        [(":method", "POST"), (":scheme", "http"), (":path", UPPER), (":authority", "x"),
         ("content-type", "application/grpc"), ("te", "trailers")]
    )  # fmt: skip
    message = b"padded"
    grpc_message = b"\x00" + struct.pack(">I", len(message)) + message
    padding = 7
    data = bytes((padding,)) + grpc_message + b"\x00" * padding
    frames = (
        PREFACE
        + _frame(SETTINGS, 0, 0)
        + _frame(HEADERS, 0, 1, block[:5])
        + _frame(CONTINUATION, END_HEADERS, 1, block[5:])
        + _frame(DATA, PADDED | END_STREAM, 1, data)
    )

    def exchange() -> list[tuple[int, int, int, bytes]]:
        with _raw(address) as sock:
            sock.sendall(frames)
            return _read_frames(sock, HEADERS, until_flags=END_STREAM)

    got = await asyncio.get_running_loop().run_in_executor(None, exchange)
    on_stream = [f for f in got if f[2] == 1]
    body = b"".join(f[3] for f in on_stream if f[0] == DATA)
    assert body == b"\x00" + struct.pack(">I", len(message)) + message.upper()
    trailers = hpack.Decoder().decode(on_stream[-1][3])  # our blocks never use the dynamic table
    assert on_stream[-1][1] & END_STREAM and ("grpc-status", "0") in trailers


# -- limits ----------------------------------------------------------------------------------


@pytest.fixture
async def limited():
    """A server with small limits, for raw-frame clients."""
    limits = H2Limits(max_concurrent_streams=2, max_connections=3, ping_burst=5, ping_per_second=0.001,
                      connection_window=1 << 17, write_buffer=1 << 16)  # fmt: skip
    server = GrpcServer({ECHO: lambda call: EchoCall(call, []), UPPER: unary(upper)}, limits=limits)
    address = await server.listen("127.0.0.1:0")
    yield server, address
    await server.stop(1.0)


def _request(path: str = UPPER, content_type: bytes = b"application/grpc") -> bytes:
    import hpack

    return hpack.Encoder().encode(
        [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "x"),
         ("content-type", content_type.decode()), ("te", "trailers")]
    )  # fmt: skip


def _settings(frames: list[tuple[int, int, int, bytes]]) -> dict[int, int]:
    payload = next(f[3] for f in frames if f[0] == SETTINGS and not f[1] & ACK)
    return dict(struct.unpack_from(">HI", payload, i) for i in range(0, len(payload), 6))


async def test_streams_past_the_advertised_limit_are_refused_and_the_rest_served(limited) -> None:
    server, address = limited
    block = _request(ECHO)

    def exchange() -> list[tuple[int, int, int, bytes]]:
        with _raw(address) as sock:
            # three open streams on a connection that allows two; then the first two end
            opening = b"".join(_frame(HEADERS, END_HEADERS, sid, block) for sid in (1, 3, 5))
            ending = b"".join(_frame(DATA, END_STREAM, sid) for sid in (1, 3))
            sock.sendall(PREFACE + _frame(SETTINGS, 0, 0) + opening + ending)
            return _read_frames(sock, -1, timeout=1.5)  # everything it answers

    frames = await asyncio.get_running_loop().run_in_executor(None, exchange)
    assert _settings(frames)[SETTINGS_MAX_CONCURRENT_STREAMS] == 2
    assert (RST_STREAM, 0, 5, struct.pack(">I", REFUSED_STREAM)) in frames
    ended = {f[2] for f in frames if f[0] == HEADERS and f[1] & END_STREAM}
    assert ended == {1, 3}
    assert server.transport.refused["stream_limit"] == 1


async def test_a_ping_flood_ends_the_connection_with_enhance_your_calm_and_is_counted(limited) -> None:
    server, address = limited

    def exchange() -> list[tuple[int, int, int, bytes]]:
        with _raw(address) as sock:
            sock.sendall(PREFACE + _frame(SETTINGS, 0, 0) + _frame(PING, 0, 0, b"01234567") * 50)
            return _read_frames(sock, GOAWAY)

    frames = await asyncio.get_running_loop().run_in_executor(None, exchange)
    assert sum(f[0] == PING for f in frames) == 5  # the burst is answered, then the connection ends
    assert struct.unpack(">I", frames[-1][3][4:8])[0] == ENHANCE_YOUR_CALM
    assert server.transport.refused["ping"] == 1


async def test_connections_past_the_limit_are_closed_at_once(limited) -> None:
    server, address = limited

    def exchange() -> bytes:
        socks = [_raw(address) for _ in range(3)]
        try:
            for sock in socks:
                sock.sendall(PREFACE + _frame(SETTINGS, 0, 0))
                assert _read_frames(sock, SETTINGS)
            with _raw(address) as extra:
                extra.settimeout(3)
                return extra.recv(100)
        finally:
            for sock in socks:
                sock.close()

    assert await asyncio.get_running_loop().run_in_executor(None, exchange) == b""  # closed without a word
    assert server.transport.refused["connection_limit"] == 1


async def test_a_request_that_is_not_grpc_gets_415_with_a_body(limited) -> None:
    _, address = limited

    def exchange() -> list[tuple[int, int, int, bytes]]:
        with _raw(address) as sock:
            block = _request(content_type=b"text/html")
            request = _frame(HEADERS, END_HEADERS | END_STREAM, 1, block)
            sock.sendall(PREFACE + _frame(SETTINGS, 0, 0) + request)
            return _read_frames(sock, DATA, until_flags=END_STREAM)

    import hpack

    frames = [f for f in await asyncio.get_running_loop().run_in_executor(None, exchange) if f[2] == 1]
    assert (":status", "415") in hpack.Decoder().decode(frames[0][3])
    assert b"only gRPC" in b"".join(f[3] for f in frames if f[0] == DATA)


async def test_data_beyond_the_connection_window_is_a_flow_control_error(limited) -> None:
    _, address = limited

    def exchange() -> list[tuple[int, int, int, bytes]]:
        with _raw(address) as sock:
            # one message larger than the window (128 KiB), never finished: nothing is given back
            header = b"\x00" + struct.pack(">I", 1 << 20)
            chunks = [header + b"x" * 16_000] + [b"x" * 16_000] * 9
            data = b"".join(_frame(DATA, 0, 1, chunk) for chunk in chunks)
            opening = _frame(HEADERS, END_HEADERS, 1, _request(ECHO))
            sock.sendall(PREFACE + _frame(SETTINGS, 0, 0) + opening + data)
            return _read_frames(sock, GOAWAY)

    frames = await asyncio.get_running_loop().run_in_executor(None, exchange)
    assert struct.unpack(">I", frames[-1][3][4:8])[0] == FLOW_CONTROL_ERROR


async def test_a_client_that_does_not_read_stops_being_read(limited) -> None:
    """Write backpressure: echoed output piles up only to the write buffer, then we stop reading."""
    server, address = limited
    message = b"\x00" + struct.pack(">I", 60_000) + b"e" * 60_000
    grants = _frame(SETTINGS, 0, 0, struct.pack(">HI", SETTINGS_INITIAL_WINDOW_SIZE, MAX_WINDOW))
    grants += _frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", MAX_WINDOW - DEFAULT_WINDOW))
    sock = _raw(address)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    sock.sendall(PREFACE + grants + _frame(HEADERS, END_HEADERS, 1, _request(ECHO)))
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    data = b"".join(_frame(DATA, 0, 1, message[i : i + 15_000]) for i in range(0, len(message), 15_000))
    sent = 0
    deadline = loop.time() + 20
    while loop.time() < deadline:  # echo 60 kB messages, read nothing, until the server stops taking them
        try:
            sent += sock.send(data)
        except BlockingIOError:
            await asyncio.sleep(0.5)
            try:
                sent += sock.send(data)
            except BlockingIOError:
                break
        await asyncio.sleep(0)
    assert loop.time() < deadline, "the server kept reading a client that reads nothing"
    conn = next(iter(server.transport.connections))
    assert conn.transport is not None
    # what waits to be written stays near the write buffer (plus one turn of frames), not the
    # ~`sent` bytes the client pushed
    assert conn.transport.get_write_buffer_size() < 4 * 1024 * 1024
    assert sent > 1024 * 1024
    sock.close()


async def test_rapid_resets_are_judged_by_their_share_of_the_streams() -> None:
    """Envoy's rule: a few quick cancellations among many answered streams are normal; a
    connection whose streams are mostly reset before an answer is ended."""
    server = GrpcServer({ECHO: lambda call: EchoCall(call, [])}, limits=H2Limits(rapid_reset_streams=20))
    address = await server.listen("127.0.0.1:0")
    block = _request(ECHO)
    answered = b"".join(_frame(HEADERS, END_HEADERS, sid, block) + _frame(DATA, END_STREAM, sid)
                        for sid in range(1, 61, 2))  # fmt: skip
    cancel = struct.pack(">I", CANCEL)

    def resets(first: int, count: int) -> bytes:
        return b"".join(_frame(HEADERS, END_HEADERS, sid, block) + _frame(RST_STREAM, 0, sid, cancel)
                        for sid in range(first, first + 2 * count, 2))  # fmt: skip

    def exchange() -> tuple[list[tuple[int, int, int, bytes]], list[tuple[int, int, int, bytes]]]:
        with _raw(address) as sock:
            # 30 answered streams, then 12 reset at once: 12 of 42 is not half
            sock.sendall(PREFACE + _frame(SETTINGS, 0, 0) + answered + resets(61, 12))
            calm = _read_frames(sock, -1, timeout=1.0)
            # 30 more resets: now most streams were reset before an answer
            sock.sendall(resets(85, 30))
            return calm, _read_frames(sock, GOAWAY)

    try:
        first, second = await asyncio.get_running_loop().run_in_executor(None, exchange)
    finally:
        await server.stop(1.0)
    assert not [f for f in first if f[0] == GOAWAY]
    assert struct.unpack(">I", second[-1][3][4:8])[0] == ENHANCE_YOUR_CALM
    assert server.transport.refused["rapid_reset"] == 1


Frames = list[tuple[int, int, int, bytes]]


def _converse(sock: socket.socket, seconds: float, answer_pings: bool) -> tuple[Frames, bool]:
    """Read frames for `seconds` (answering PINGs if asked); (frames, whether the server closed)."""
    frames: list[tuple[int, int, int, bytes]] = []
    data = b""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except OSError:
            return frames, True
        if not chunk:
            return frames, True
        data += chunk
        while len(data) >= 9 and len(data) >= 9 + int.from_bytes(data[:3], "big"):
            length = int.from_bytes(data[:3], "big")
            got = (data[3], data[4], int.from_bytes(data[5:9], "big"), data[9 : 9 + length])
            data = data[9 + length :]
            frames.append(got)
            if answer_pings and got[0] == PING and not got[1] & ACK:
                sock.sendall(_frame(PING, ACK, 0, got[3]))
    return frames, False


@pytest.fixture
async def quick_idle():
    server = GrpcServer({ECHO: lambda call: EchoCall(call, [])}, limits=H2Limits(idle_timeout=0.3, preface_timeout=0.3))
    address = await server.listen("127.0.0.1:0")
    yield server, address
    await server.stop(1.0)


@pytest.mark.parametrize("answer_pings", [True, False], ids=["alive", "gone"])
async def test_a_quiet_client_with_a_stream_open_is_asked_if_it_is_still_there(quick_idle, answer_pings: bool) -> None:
    """A held request keeps its connection as long as the client answers our PINGs; a peer that
    vanished without a FIN (half-open) is closed after two idle periods."""
    _, address = quick_idle

    def exchange() -> tuple[list[tuple[int, int, int, bytes]], bool]:
        with _raw(address) as sock:
            sock.sendall(PREFACE + _frame(SETTINGS, 0, 0) + _frame(HEADERS, END_HEADERS, 1, _request(ECHO)))
            return _converse(sock, 2.5, answer_pings)

    frames, closed = await asyncio.get_running_loop().run_in_executor(None, exchange)
    assert [f for f in frames if f[0] == PING and not f[1] & ACK], "no liveness PING"
    assert closed is not answer_pings
    assert not [f for f in frames if f[0] == GOAWAY]


async def test_an_idle_connection_is_closed_the_graceful_way_and_a_silent_one_at_once(quick_idle) -> None:
    server, address = quick_idle

    def exchange() -> tuple[list[tuple[int, int, int, bytes]], bool, bool]:
        with _raw(address) as idle, _raw(address) as silent:
            idle.sendall(PREFACE + _frame(SETTINGS, 0, 0))
            frames, closed = _converse(idle, 3.0, answer_pings=True)
            _, silent_closed = _converse(silent, 0.1, answer_pings=False)  # already closed by now
            return frames, closed, silent_closed

    frames, closed, silent_closed = await asyncio.get_running_loop().run_in_executor(None, exchange)
    goaways = [struct.unpack(">II", f[3][:8]) for f in frames if f[0] == GOAWAY]
    assert goaways == [(MAX_WINDOW, NO_ERROR), (0, NO_ERROR)]  # announced, then final
    assert closed and silent_closed
    assert server.transport.refused["preface_timeout"] == 1


async def test_a_ping_flood_under_the_shipped_limits_is_cut_within_the_documented_burst(served) -> None:
    """The limits tests and the real-gateway floods set their own small burst; this is what a
    server started with no --h2-limit does."""
    from tests.extproc.h2grpc.test_limits import documented_defaults

    server, channel, address, _ = served
    burst = int(documented_defaults()["ping_burst"])

    def exchange() -> list[tuple[int, int, int, bytes]]:
        with _raw(address) as sock:
            sock.sendall(PREFACE + _frame(SETTINGS, 0, 0) + _frame(PING, 0, 0, b"01234567") * (20 * burst))
            return _read_frames(sock, GOAWAY)

    frames = await asyncio.get_running_loop().run_in_executor(None, exchange)
    answered = sum(f[0] == PING for f in frames)
    # the burst, and what the documented 10/s refills while the flood is read: never the flood
    assert burst <= answered <= burst + 10, answered
    assert frames[-1][0] == GOAWAY and struct.unpack(">I", frames[-1][3][4:8])[0] == ENHANCE_YOUR_CALM
    assert server.transport.refused["ping"] == 1
    assert await channel.unary_unary(UPPER)(b"fine") == b"FINE"  # only that connection ended
