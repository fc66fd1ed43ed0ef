"""Graceful exit for every long-running `wakegate` process: the first signal drains, a second exits.

SIGTERM or SIGINT sets the process's stop event (stop admitting, finish what is in flight,
then exit); another one while draining ends the process at once with status 130.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

log = logging.getLogger("wakegate")


def graceful_exit(stop: asyncio.Event, name: str) -> None:
    """Wire SIGTERM/SIGINT of the running loop to `stop`; call from inside the loop."""
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            log.warning("%s: second %s, exiting now", name, sig.name)
            os._exit(130)
        log.info("%s: %s received, draining", name, sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
