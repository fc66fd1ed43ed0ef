"""Many concurrent requests over a few HTTP/2 connections (prior knowledge, cleartext).

The benchmarks' multiplexing client: `tests/bench/bench_cold.py --held-h2 C` holds thousands of
requests over C connections, where aiohttp (HTTP/1.1 only) needs one connection per request.
Frames are made by hand (literal header fields, no Huffman) and answers decoded with the
`hpack` package; flow control is only what a small request needs: the server's windows are
never exceeded (bodies are sent whole, at most 16 KiB), and every DATA frame received is given
back at once. Nothing here is shipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from dataclasses import dataclass, field

from hpack import Decoder

from wakegate.extproc.h2grpc.hpack import literal

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
#: Our receive windows: large, so answers never wait for a WINDOW_UPDATE.
WINDOW = 1 << 30


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream_id) + payload


@dataclass
class Answer:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    error: str = ""


class Connection:
    """One HTTP/2 connection carrying many requests at once."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = Decoder()
        self.decoder.max_allowed_table_size = 65536
        self.streams: dict[int, tuple[Answer, asyncio.Future[Answer]]] = {}
        self.next_id = 1
        self.block = b""
        self.reading = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(host, port)
        # SETTINGS_INITIAL_WINDOW_SIZE (4) = 2^30 - 1; the connection window grown to match.
        writer.write(PREFACE + frame(SETTINGS, 0, 0, struct.pack(">HI", 4, WINDOW - 1)))
        writer.write(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", WINDOW - 65535)))
        await writer.drain()
        return cls(reader, writer)

    def request(
        self, method: str, path: str, authority: str, headers: dict[str, str], body: bytes
    ) -> asyncio.Future[Answer]:
        stream = self.next_id
        self.next_id += 2
        fields = [(":method", method), (":scheme", "http"), (":path", path), (":authority", authority)]
        fields += headers.items()
        if body:
            fields.append(("content-length", str(len(body))))
        block = b"".join(literal(k.encode(), v.encode()) for k, v in fields)
        self.writer.write(frame(HEADERS, END_HEADERS | (0 if body else END_STREAM), stream, block))
        if body:
            self.writer.write(frame(DATA, END_STREAM, stream, body))
        done: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self.streams[stream] = (Answer(), done)
        return done

    async def drain(self) -> None:
        await self.writer.drain()

    async def reset(self, stream: int) -> None:
        """Cancel one request (RST_STREAM CANCEL), as a client that went away."""
        self.writer.write(frame(RST_STREAM, 0, stream, struct.pack(">I", 8)))
        self._end(stream, "reset by the client")
        await self.writer.drain()

    def _end(self, stream: int, error: str = "") -> None:
        entry = self.streams.pop(stream, None)
        if entry is not None and not entry[1].done():
            entry[0].error = error
            entry[1].set_result(entry[0])

    async def _read(self) -> None:
        try:
            while True:
                head = await self.reader.readexactly(9)
                length = int.from_bytes(head[:3], "big")
                kind, flags = head[3], head[4]
                stream = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
                payload = await self.reader.readexactly(length)
                self._frame(kind, flags, stream, payload)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            for stream in list(self.streams):
                self._end(stream, f"connection ended: {type(exc).__name__}")

    def _frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if kind == SETTINGS and not flags & ACK:
            self.writer.write(frame(SETTINGS, ACK, 0))
        elif kind == PING and not flags & ACK:
            self.writer.write(frame(PING, ACK, 0, payload))
        elif kind in (HEADERS, CONTINUATION):
            if kind == HEADERS:
                if flags & PADDED:
                    payload = payload[1 : len(payload) - payload[0]]
                if flags & PRIORITY_FLAG:
                    payload = payload[5:]
            self.block += payload
            if flags & END_HEADERS:
                fields = self.decoder.decode(self.block)
                self.block = b""
                entry = self.streams.get(stream)
                if entry is not None:
                    for name, value in fields:
                        if name == ":status":
                            entry[0].status = int(value)
                        else:
                            entry[0].headers[name] = value
            if flags & END_STREAM:
                self._end(stream)
        elif kind == DATA:
            if flags & PADDED:
                payload = payload[1 : len(payload) - payload[0]]
            entry = self.streams.get(stream)
            if entry is not None and len(entry[0].body) < 4096:
                entry[0].body += payload[: 4096 - len(entry[0].body)]
            if length := len(payload):
                self.writer.write(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", length)))
            if flags & END_STREAM:
                self._end(stream)
        elif kind == RST_STREAM:
            self._end(stream, f"reset {int.from_bytes(payload[:4], 'big')}")
        elif kind == GOAWAY:
            last = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            for open_stream in [s for s in self.streams if s > last]:
                self._end(open_stream, "refused by GOAWAY")

    async def close(self) -> None:
        self.reading.cancel()
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()
