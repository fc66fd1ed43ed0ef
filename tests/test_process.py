"""Every long-running command drains on the first signal and exits on the second."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time


def test_first_signal_drains_second_exits_at_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "drainer.py"
    script.write_text(textwrap.dedent("""
        import asyncio, sys
        from wakegate.process import graceful_exit

        async def main():
            stop = asyncio.Event()
            graceful_exit(stop, "test")
            print("ready", flush=True)
            await stop.wait()
            print("draining", flush=True)
            await asyncio.sleep(60)  # a drain that would take long

        asyncio.run(main())
    """))
    with subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline().strip() == "draining"
        started = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(10) == 130
        assert time.monotonic() - started < 5


def test_every_process_logs_one_format() -> None:
    script = (
        "from wakegate.process import log_level, setup_logging; import logging; "
        "setup_logging(log_level('warn')); logging.getLogger('wakegate.x').warning('hello %s', 1); "
        "logging.getLogger('wakegate.x').info('hidden')"
    )
    err = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stderr
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING wakegate\.x hello 1\n", err), err
