"""Request completions from Envoy's access-log stream: what ends a routed request's in-flight count.

extproc ends its ext_proc stream as soon as it has decided a request (docs/decisions.md,
"extproc lets go of a request once it is decided"), so the stream's end no longer tells it
when the request is over. Envoy tells it instead: the listener's gRPC access logger streams
one `HTTPAccessLogEntry` per finished request to every extproc (one logger per extproc,
batching off), and each entry carries the request's `x-request-id`. The listener removes any
`x-request-id` a client sent before Envoy assigns one (an early header mutation), so every
id is Envoy's own UUID, known to extproc from the request's headers before it decides. Each
process releases exactly the requests it counted, once, and ignores the rest (the other
extproc's, or those of its own previous life before a restart). Keying on the id rather than
on something extproc adds to the request means a request whose decision never reached Envoy
(the client left at that moment) is still released by its entry.

The stream cannot cut traffic: an access logger that cannot reach its extproc drops entries,
it never fails a request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from envoy.service.accesslog.v3 import als_pb2
from google.protobuf.message import DecodeError

from wakegate.contract import EXTPROC_CLUSTER
from wakegate.extproc.budget import USAGE_NAMESPACE
from wakegate.extproc.h2grpc.call import INVALID_ARGUMENT, Call

log = logging.getLogger("wakegate.extproc")

ACCESS_LOG_SERVICE = "envoy.service.accesslog.v3.AccessLogService"
STREAM_ACCESS_LOGS_METHOD = f"/{ACCESS_LOG_SERVICE}/StreamAccessLogs"
REQUEST_ID_HEADER = "x-request-id"


class Completions:
    """Routed requests waiting for their access-log entry, by request id."""

    def __init__(self, on_end: Callable[[str, str | None, str | None], None]) -> None:
        self._on_end = on_end
        #: request id -> (model key, endpoint, on-demand adapter)
        self._pending: dict[str, tuple[str, str | None, str | None]] = {}
        self._streams: set[_LogStream] = set()
        #: (tenant, tokens) of each logged request of a tenant with a token budget (extproc/budget.py).
        self.on_usage: Callable[[str, int], None] = lambda tenant, tokens: None
        self.entries = 0
        """Access-log entries received (all of them, ours or not)."""

    def track(self, request_id: str, model_key: str, endpoint: str | None, adapter: str | None = None) -> bool:
        """A request was routed and counted; False if its id is already pending (then the
        caller keeps the request's ext_proc stream open and releases it when that ends)."""
        if not request_id or request_id in self._pending:
            return False
        self._pending[request_id] = (model_key, endpoint, adapter)
        return True

    @property
    def pending(self) -> int:
        return len(self._pending)

    def logged(self, data: bytes) -> None:
        """One StreamAccessLogsMessage: release every request of ours it reports as finished."""
        message = als_pb2.StreamAccessLogsMessage.FromString(data)
        entries = message.http_logs.log_entry
        self.entries += len(entries)
        pending = self._pending
        for entry in entries:
            if entry.common_properties.upstream_cluster == EXTPROC_CLUSTER:
                continue  # a parked request's first pass (extproc/park.py); its second is logged too
            found = pending.pop(entry.request.request_id, None)
            if found is not None:
                self._on_end(*found)
            usage = entry.common_properties.metadata.filter_metadata.get(USAGE_NAMESPACE)
            if usage is not None:  # a budgeted tenant's request, whichever extproc decided it
                fields = usage.fields
                if "tenant" in fields and "tokens" in fields:
                    self.on_usage(fields["tenant"].string_value, int(fields["tokens"].number_value))

    def call(self, call: Call) -> _LogStream:
        stream = _LogStream(self, call)
        self._streams.add(stream)
        return stream

    def forget(self, stream: _LogStream) -> None:
        self._streams.discard(stream)

    def close(self) -> None:
        """End every access-log stream (shutting down): they never end on their own, and a
        draining server waits for the calls it has."""
        for stream in list(self._streams):
            stream.end()


class _LogStream:
    """One StreamAccessLogs call from one Envoy worker; Envoy never expects a reply until it closes."""

    __slots__ = ("_call", "_completions")

    def __init__(self, completions: Completions, call: Call) -> None:
        self._completions = completions
        self._call = call

    def on_message(self, data: bytes) -> None:
        try:
            self._completions.logged(data)
        except DecodeError:
            log.warning("access-log stream sent a message that is not a StreamAccessLogsMessage; closing it")
            self._call.finish(INVALID_ARGUMENT, "not a StreamAccessLogsMessage")

    def on_half_close(self) -> None:
        self.end()

    def on_cancel(self) -> None:
        self._completions.forget(self)

    def end(self) -> None:
        self._completions.forget(self)
        self._call.send(b"")  # StreamAccessLogsResponse is empty
        self._call.finish()
