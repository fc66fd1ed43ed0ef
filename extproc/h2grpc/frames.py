"""HTTP/2's wire vocabulary (RFC 9113): frame types, flags, settings, error codes, default sizes,
the frame header, and the errors that end a stream or a connection.
"""

from __future__ import annotations

import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types (RFC 9113 §6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
# Flags.
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
# Settings.
SETTINGS_HEADER_TABLE_SIZE = 0x1
SETTINGS_ENABLE_PUSH = 0x2
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
SETTINGS_MAX_FRAME_SIZE = 0x5
SETTINGS_MAX_HEADER_LIST_SIZE = 0x6
# Error codes.
NO_ERROR = 0x0
PROTOCOL_ERROR = 0x1
INTERNAL_ERROR = 0x2
FLOW_CONTROL_ERROR = 0x3
STREAM_CLOSED = 0x5
FRAME_SIZE_ERROR = 0x6
REFUSED_STREAM = 0x7
CANCEL = 0x8
COMPRESSION_ERROR = 0x9
ENHANCE_YOUR_CALM = 0xB

MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65_535
DEFAULT_FRAME_SIZE = 16_384
#: Top a stream's receive window up once this much of it has been used.
WINDOW_REFILL = 1 << 30

FRAME_HEADER = struct.Struct(">I")


class ProtocolError(Exception):
    def __init__(self, code: int, reason: str, refusal: str = "") -> None:
        super().__init__(reason)
        self.code = code
        #: For ENHANCE_YOUR_CALM: which limit it was (the server counts refusals by it).
        self.refusal = refusal


def calm(refusal: str, reason: str) -> ProtocolError:
    return ProtocolError(ENHANCE_YOUR_CALM, reason, refusal)


class StreamError(Exception):
    """A malformed request: the stream is reset with `code`, the connection goes on."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


def frame(kind: int, flags: int, stream_id: int, payload: bytes | memoryview = b"") -> bytes:
    return FRAME_HEADER.pack(len(payload))[1:] + bytes((kind, flags)) + FRAME_HEADER.pack(stream_id) + payload


def unpad(payload: bytes) -> bytes:
    if not payload:
        raise ProtocolError(PROTOCOL_ERROR, "padded frame without a pad length")
    pad = payload[0]
    if pad >= len(payload):
        raise ProtocolError(PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1 : len(payload) - pad]
