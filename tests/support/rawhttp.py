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

from wakegate.extproc.h2grpc import connection as h2


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
    out = [h2.PREFACE, h2.frame(h2.SETTINGS, 0, 0)]
    for n, (headers, body) in enumerate(streams):
        stream_id = 2 * n + 1
        block = encoder.encode(headers, huffman=False)
        pieces = [block[i : i + h2.DEFAULT_FRAME_SIZE] for i in range(0, len(block), h2.DEFAULT_FRAME_SIZE)] or [b""]
        end = 0 if body else h2.END_STREAM
        out.append(h2.frame(h2.HEADERS, end | (h2.END_HEADERS if len(pieces) == 1 else 0), stream_id, pieces[0]))
        for i, piece in enumerate(pieces[1:], 2):
            out.append(h2.frame(h2.CONTINUATION, h2.END_HEADERS if i == len(pieces) else 0, stream_id, piece))
        if body:
            out.append(h2.frame(h2.DATA, h2.END_STREAM, stream_id, body))
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
                kind, flags, stream_id = data[3], data[4], int.from_bytes(data[5:9], "big") & h2.MAX_WINDOW
                payload, data = data[9 : 9 + length], data[9 + length :]
                reply = replies.get(stream_id)
                if kind == h2.SETTINGS and not flags & h2.ACK:
                    sock.sendall(h2.frame(h2.SETTINGS, h2.ACK, 0))
                elif kind == h2.GOAWAY:
                    goaway = f"goaway:{struct.unpack('>I', payload[4:8])[0]}"
                    last = struct.unpack(">I", payload[:4])[0] & h2.MAX_WINDOW
                    for gone in [s for s in open_ids if s > last]:  # never processed
                        replies[gone].ended = goaway
                        open_ids.discard(gone)
                elif reply is None:
                    continue
                elif kind == h2.HEADERS:
                    for name, value in decoder.decode(payload):
                        reply.headers[str(name)] = str(value)
                    reply.status = int(reply.headers.get(":status", 0))
                elif kind == h2.DATA:
                    reply.body += payload
                elif kind == h2.RST_STREAM:
                    reply.ended = f"reset:{struct.unpack('>I', payload)[0]}"
                    open_ids.discard(stream_id)
                if kind in (h2.HEADERS, h2.DATA) and flags & h2.END_STREAM:
                    open_ids.discard(stream_id)
    return replies
