"""A stand-in gateway for the scaler tests: extproc's real DemandReporter with fixed demand.

    python -m tests.support.reporter TARGET GATEWAY_ID MODEL IN_FLIGHT [TOKEN_FILE]

SIGTERM shuts it down like a gateway (the reporter withdraws); SIGKILL leaves its share to expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from pathlib import Path

from wakegate.extproc.demand import DemandReporter
from wakegate.internal_token import TokenSource


async def main(target: str, gateway_id: str, model: str, in_flight: int, token_file: Path | None) -> None:
    token = TokenSource(token_file) if token_file else None
    reporter = DemandReporter(target, gateway_id, dict, lambda: {model: in_flight}, token=token)
    task = asyncio.create_task(reporter.run())
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    print("reporting", flush=True)
    with contextlib.suppress(asyncio.CancelledError):
        await task


if __name__ == "__main__":
    target, gateway_id, model, in_flight = sys.argv[1:5]
    token = Path(sys.argv[5]) if len(sys.argv) > 5 else None
    asyncio.run(main(target, gateway_id, model, int(in_flight), token))
