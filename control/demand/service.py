"""The DemandService gRPC face of the demand book: gateways report here (`wakegate up`, `wakegate scaler`).

With a token file, every report must carry `authorization: Bearer <token>`, compared in
constant time; the file is read on each report, so a rotated Secret applies at once.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from wakegate.control.demand.book import DemandBook
from wakegate.v1 import demand_pb2, demand_pb2_grpc


class DemandService(demand_pb2_grpc.DemandServiceServicer):  # type: ignore[misc]
    """gRPC face of the book. With a token file, reports must carry `authorization: Bearer <token>`."""

    def __init__(
        self,
        book: DemandBook,
        on_change: Callable[[], None],
        *,
        token_file: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.book = book
        self._on_change = on_change
        self._token_file = token_file
        self._clock = clock

    def _authorized(self, context: grpc.aio.ServicerContext) -> bool:
        if self._token_file is None:
            return True
        try:
            expected = self._token_file.read_text(encoding="utf-8").strip().encode()
        except OSError:
            return False
        presented = b""
        for key, value in context.invocation_metadata() or ():
            if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
                presented = value[len("Bearer ") :].encode()
        return bool(expected) and hmac.compare_digest(presented, expected)

    async def Report(
        self, request: demand_pb2.DemandReport, context: grpc.aio.ServicerContext
    ) -> demand_pb2.ReportReply:
        if not self._authorized(context):
            self.book.rejections.unauthenticated += 1
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid demand token")
        accepted, reason = self.book.apply(request, self._clock())
        if accepted:
            self._on_change()
        return demand_pb2.ReportReply(accepted=accepted, reason=reason)
