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
    script.write_text(
        textwrap.dedent("""
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
    """)
    )
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


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_throttled_log_writes_a_few_lines_per_second_per_kind_and_counts_the_rest(caplog) -> None:  # type: ignore[no-untyped-def]
    import logging

    from wakegate.process import ThrottledLog

    clock = _Clock()
    throttled = ThrottledLog(logging.getLogger("wakegate.test.throttled"), per_second=3, clock=clock)
    with caplog.at_level(logging.INFO, logger="wakegate.test.throttled"):
        written = [throttled.log(logging.INFO, "invalid_json", "refused %s", n) for n in range(1000)]
        assert written == [True] * 3 + [False] * 997
        assert throttled.log(logging.INFO, "duplicate_model", "other kind")  # its own share
        clock.now += 0.5
        assert not throttled.log(logging.INFO, "invalid_json", "still the same second")
        clock.now += 0.6
        assert throttled.log(logging.INFO, "invalid_json", "refused %s", "next")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["refused 0", "refused 1", "refused 2", "other kind", "refused next (+998 suppressed)"]
    assert all(r.exc_info is None for r in caplog.records)


def test_throttled_log_tracks_a_bounded_number_of_kinds() -> None:
    import logging

    from wakegate.process import ThrottledLog

    throttled = ThrottledLog(logging.getLogger("wakegate.test.kinds"), max_kinds=10, clock=_Clock())
    logging.getLogger("wakegate.test.kinds").setLevel(logging.INFO)
    for n in range(10_000):
        throttled.log(logging.INFO, f"kind-{n}", "x")
    assert len(throttled._kinds) <= 10
