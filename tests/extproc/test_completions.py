"""Completions: each routed request is released once, by its own access-log entry, and nothing else is."""

from __future__ import annotations

from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2

from wakegate.extproc.completions import Completions


def _message(*request_ids: str) -> bytes:
    entries = [
        accesslog_pb2.HTTPAccessLogEntry(request=accesslog_pb2.HTTPRequestProperties(request_id=r)) for r in request_ids
    ]
    message = als_pb2.StreamAccessLogsMessage(
        http_logs=als_pb2.StreamAccessLogsMessage.HTTPAccessLogEntries(log_entry=entries)
    )
    return bytes(message.SerializeToString())


def test_each_tracked_request_is_released_once_by_its_entry() -> None:
    ended: list[tuple[str, str | None]] = []
    completions = Completions(lambda key, endpoint, _adapter: ended.append((key, endpoint)))
    assert completions.track("r1", "m", "10.0.0.1:8000")
    assert completions.track("r2", "m", None)
    completions.logged(_message("r2"))
    assert ended == [("m", None)]
    completions.logged(_message("r2", "r1", "r1"))  # a repeated entry releases nothing more
    assert ended == [("m", None), ("m", "10.0.0.1:8000")]
    assert completions.pending == 0
    assert completions.entries == 4


def test_entries_of_requests_routed_elsewhere_are_ignored() -> None:
    ended: list[tuple[str, str | None]] = []
    completions = Completions(lambda key, endpoint, _adapter: ended.append((key, endpoint)))
    assert completions.track("mine", "m", None)
    completions.logged(_message("the-other-extprocs", ""))
    assert ended == []
    assert completions.pending == 1


def test_an_id_already_pending_or_missing_is_not_tracked() -> None:
    completions = Completions(lambda key, endpoint, _adapter: None)
    assert completions.track("r1", "m", None)
    assert not completions.track("r1", "m", None)  # the caller keeps that request's stream instead
    assert not completions.track("", "m", None)
    assert completions.pending == 1
