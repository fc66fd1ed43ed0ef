"""HTTP on a bare socket, for requests no client library would send (malformed on purpose).

`http1` writes the bytes it is given and reads one reply; `http2` opens a prior-knowledge
HTTP/2 connection, sends one header block (and body) per stream, and reports how each
stream ended: its reply, or the RST_STREAM / GOAWAY that ended it.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

import hpack

from wakegate.extproc.h2grpc.frames import (
    ACK,
    CONTINUATION,
    DATA,
    DEFAULT_FRAME_SIZE,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    MAX_WINDOW,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    frame,
)


@dataclass
class Reply:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    #: How the exchange ended when it was not a complete reply: "reset:<code>", "goaway:<code>"
    #: (the connection ended with that error before the reply), "closed" or "timeout"; empty
    #: for a complete reply.
    ended: str = ""

    def error(self) -> dict[str, Any]:
        """The OpenAI error object of a shaped reply (fails the test when the reply is not one)."""
        assert self.headers.get("content-type", "").startswith("application/json"), (self.status, self.headers)
        document = json.loads(self.body)
        assert set(document) == {"error"}, document
        error: dict[str, Any] = document["error"]
        assert {"message", "type", "code"} <= set(error) and all(
            isinstance(error[k], str) and error[k] for k in ("message", "type", "code")
        ), error
        return error


def http1(port: int, data: bytes, timeout: float = 30.0) -> Reply:
    """Send `data` as is on a new connection; read the first reply (or how the connection ended)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)  # Envoy may answer and close before it has read everything
        reader = sock.makefile("rb")
        try:
            return _read_http1(reader)
        except TimeoutError:
            return Reply(ended="timeout")
        except (ConnectionResetError, ValueError):
            return Reply(ended="closed")


def _read_http1(reader: Any) -> Reply:
    while True:
        line = reader.readline(65536)
        if not line:
            return Reply(ended="closed")
        _, status, _ = line.decode("latin-1").split(" ", 2)
        headers: dict[str, str] = {}
        while (line := reader.readline(65536)) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if int(status) >= 200:  # skip 100 Continue
            break
    if "content-length" in headers:
        body = reader.read(int(headers["content-length"]))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while (size := int(reader.readline(1024).split(b";")[0], 16)) > 0:
            body += reader.read(size)
            reader.readline(16)
    else:
        body = reader.read()
    return Reply(int(status), headers, body)


def http2(port: int, streams: list[tuple[list[tuple[str, str]], bytes]], timeout: float = 30.0) -> dict[int, Reply]:
    """One connection, one stream per (headers, body) in order (ids 1, 3, 5, ...): how each ended."""
    encoder = hpack.Encoder()
    out = [PREFACE, frame(SETTINGS, 0, 0)]
    for n, (headers, body) in enumerate(streams):
        stream_id = 2 * n + 1
        block = encoder.encode(headers, huffman=False)
        pieces = [block[i : i + DEFAULT_FRAME_SIZE] for i in range(0, len(block), DEFAULT_FRAME_SIZE)] or [b""]
        end = 0 if body else END_STREAM
        out.append(frame(HEADERS, end | (END_HEADERS if len(pieces) == 1 else 0), stream_id, pieces[0]))
        for i, piece in enumerate(pieces[1:], 2):
            out.append(frame(CONTINUATION, END_HEADERS if i == len(pieces) else 0, stream_id, piece))
        if body:
            out.append(frame(DATA, END_STREAM, stream_id, body))
    replies = {2 * n + 1: Reply() for n in range(len(streams))}
    open_ids = set(replies)
    decoder = hpack.Decoder()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(b"".join(out))
        data = b""
        goaway = ""
        while open_ids:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                chunk, reason = b"", "timeout"
            except ConnectionResetError:
                chunk, reason = b"", goaway or "closed"
            else:
                reason = goaway or "closed"
            if not chunk:
                for stream_id in open_ids:
                    replies[stream_id].ended = reason
                break
            data += chunk
            while len(data) >= 9 and len(data) >= 9 + (length := int.from_bytes(data[:3], "big")):
                kind, flags, stream_id = data[3], data[4], int.from_bytes(data[5:9], "big") & MAX_WINDOW
                payload, data = data[9 : 9 + length], data[9 + length :]
                reply = replies.get(stream_id)
                if kind == SETTINGS and not flags & ACK:
                    sock.sendall(frame(SETTINGS, ACK, 0))
                elif kind == GOAWAY:
                    goaway = f"goaway:{struct.unpack('>I', payload[4:8])[0]}"
                    last = struct.unpack(">I", payload[:4])[0] & MAX_WINDOW
                    for gone in [s for s in open_ids if s > last]:  # never processed
                        replies[gone].ended = goaway
                        open_ids.discard(gone)
                elif reply is None:
                    continue
                elif kind == HEADERS:
                    for name, value in decoder.decode(payload):
                        reply.headers[str(name)] = str(value)
                    reply.status = int(reply.headers.get(":status", 0))
                elif kind == DATA:
                    reply.body += payload
                elif kind == RST_STREAM:
                    reply.ended = f"reset:{struct.unpack('>I', payload)[0]}"
                    open_ids.discard(stream_id)
                if kind in (HEADERS, DATA) and flags & END_STREAM:
                    open_ids.discard(stream_id)
    return replies
