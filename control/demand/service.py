"""The DemandService gRPC face of the demand book: gateways report here (`wakegate up`, `wakegate scaler`).

With an authenticator, every report must carry the internal token (wakegate.internal_token:
compared in constant time, the file re-read when it changes, so a rotated Secret applies
without a restart); a report without it is refused with UNAUTHENTICATED and counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc

from wakegate.control.demand.book import DemandBook
from wakegate.internal_token import Authenticator
from wakegate.v1 import demand_pb2, demand_pb2_grpc


class DemandService(demand_pb2_grpc.DemandServiceServicer):  # type: ignore[misc]
    """gRPC face of the book. With an authenticator, reports must carry the internal token."""

    def __init__(
        self,
        book: DemandBook,
        on_change: Callable[[], None],
        *,
        authenticator: Authenticator | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.book = book
        self._on_change = on_change
        self._authenticator = authenticator
        self._clock = clock

    async def Report(
        self, request: demand_pb2.DemandReport, context: grpc.aio.ServicerContext
    ) -> demand_pb2.ReportReply:
        if self._authenticator is not None and not self._authenticator.allows(context, "demand"):
            self.book.rejections.unauthenticated += 1
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid wakegate token")
        accepted, reason = self.book.apply(request, self._clock())
        if accepted:
            self._on_change()
        return demand_pb2.ReportReply(accepted=accepted, reason=reason)
