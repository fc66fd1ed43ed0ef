"""What a request's header block must be (RFC 9113 §8): pseudo-headers, names, connection-specific fields."""

from __future__ import annotations

from wakegate.extproc.h2grpc.frames import PROTOCOL_ERROR, StreamError

#: The request pseudo-headers, each a bit (:path is 4: it must not be empty; the first three must be there).
_PSEUDO_BITS = {b":method": 1, b":scheme": 2, b":path": 4, b":authority": 8}
#: Regular fields a request is checked for: 0 connection-specific (never allowed), 1 te, 2 content-length.
_SPECIAL_HEADERS = {
    b"connection": 0, b"keep-alive": 0, b"proxy-connection": 0, b"transfer-encoding": 0, b"upgrade": 0,
    b"te": 1, b"content-length": 2,
}  # fmt: skip


def check_request(headers: list[tuple[bytes, bytes]]) -> int | None:
    """Raise _StreamError for a malformed request (RFC 9113 §8.2-8.3); its content-length, if any."""
    seen = 0
    regular = False
    length: int | None = None
    for name, value in headers:
        bit = _PSEUDO_BITS.get(name)
        if bit is not None:
            if regular or seen & bit:
                raise StreamError(PROTOCOL_ERROR, "pseudo-header repeated or after a regular header")
            if bit == 4 and not value:
                raise StreamError(PROTOCOL_ERROR, "empty :path")
            seen |= bit
            continue
        regular = True
        if name[:1] == b":":
            raise StreamError(PROTOCOL_ERROR, "unknown or response pseudo-header")
        if not name.islower() and name.lower() != name:
            raise StreamError(PROTOCOL_ERROR, "uppercase header name")
        special = _SPECIAL_HEADERS.get(name)
        if special is None:
            continue
        if special == 0:
            raise StreamError(PROTOCOL_ERROR, "connection-specific header")
        if special == 1:
            if value != b"trailers":
                raise StreamError(PROTOCOL_ERROR, "te other than trailers")
        elif not value.isdigit() or (length is not None and int(value) != length):
            raise StreamError(PROTOCOL_ERROR, "bad content-length")
        else:
            length = int(value)
    if seen & 7 != 7:
        raise StreamError(PROTOCOL_ERROR, "missing :method, :scheme or :path")
    return length
