"""One ext_proc gRPC call (`ProcessCall`): its messages to the Processor's decisions, held
requests awaited, answers written back, the call's end.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import duration_pb2
from google.protobuf.message import DecodeError

from wakegate.extproc.exchange import BUFFER_BODY, BUFFER_BODY_COUNTED, STOPPING, Cold, Exchange
from wakegate.extproc.h2grpc.call import INTERNAL, INVALID_ARGUMENT, Call

if TYPE_CHECKING:
    from wakegate.extproc.service import Processor

log = logging.getLogger("wakegate.extproc")


class ProcessCall:
    """One ext_proc stream. Answers on the event loop thread; only a held request gets a task.

    Envoy sends one message per phase and waits for its answer, so at most one message is
    decided at a time; one arriving while a cold request is held waits behind it. The stream
    ends with Envoy's half-close (answered with status OK) or a reset; if a request is still
    held then, its client went away and it leaves the queue. Either way the request's
    in-flight count is released once.
    """

    __slots__ = ("_backlog", "_call", "_exchange", "_held", "_proc")

    def __init__(self, proc: Processor, call: Call) -> None:
        self._proc = proc
        self._call = call
        self._exchange = Exchange()
        self._held: asyncio.Task[None] | None = None
        self._backlog: list[bytes] = []

    def on_message(self, data: bytes) -> None:
        if self._held is not None:
            self._backlog.append(data)
            return
        self._handle(data)

    def on_half_close(self) -> None:
        # Envoy half-closes when it is done with the request; if a message is still held,
        # nobody waits for its answer any more (the client went away): as for a reset.
        self.on_cancel()
        self._call.finish()

    def on_cancel(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.cancel()
        self._close()

    def let_go(self) -> None:
        """Answer the held request with the retriable 503 now (extproc is stopping)."""
        held, self._held = self._held, None
        if held is None:
            return
        held.cancel()
        self._close()
        self._proc._done(None, STOPPING, "503", "gateway_unavailable")
        self._call.send(STOPPING.SerializeToString())
        self._call.finish()

    def _answer(self, decided: ep.ProcessingResponse) -> None:
        """Send a decision; once the request needs nothing more from us, end the stream, so
        that Envoy carries the rest of the request without this process."""
        self._call.send(decided.SerializeToString())
        ex = self._exchange
        if (
            decided is not BUFFER_BODY
            and decided is not BUFFER_BODY_COUNTED
            and ex.model_key is None
            and ex.usage is None
            and self._proc.gw.completions is not None
        ):
            self._call.finish()

    def _handle(self, data: bytes) -> None:
        try:
            message = ep.ProcessingRequest.FromString(data)
        except DecodeError:
            self._close()
            self._call.finish(INVALID_ARGUMENT, "not an ext_proc ProcessingRequest")
            return
        try:
            decided = self._proc.decide(self._exchange, message)
        except Exception as exc:
            decided = self._proc.failed(exc)
        if isinstance(decided, Cold):
            timeout_s = decided.timeout_s()
            # Tell Envoy this message may take up to the activation (or queue) timeout.
            self._call.send(
                ep.ProcessingResponse(
                    override_message_timeout=duration_pb2.Duration(seconds=int(decided.longest_s()) + 1)
                ).SerializeToString()
            )
            self._held = asyncio.get_running_loop().create_task(self._hold(decided, self._exchange.started + timeout_s))
            self._proc.holding.add(self)
            return
        self._answer(decided)

    async def _hold(self, cold: Cold, deadline: float) -> None:
        try:
            decided = await self._proc.hold(self._exchange, cold, deadline)
        except asyncio.CancelledError:
            return  # on_cancel already released the request
        except Exception:
            log.exception("holding a cold request failed")
            self._held = None
            self._close()
            self._call.finish(INTERNAL, "internal error")
            return
        self._held = None
        self._proc.holding.discard(self)
        self._answer(decided)
        while self._backlog and self._held is None and not self._call.finished:
            self._handle(self._backlog.pop(0))

    def _close(self) -> None:
        self._proc.holding.discard(self)
        self._backlog.clear()
        self._proc.release(self._exchange)
