"""Progress: rate and ETA from the bytes seen, and how the commands print it."""

from __future__ import annotations

import io

from wakegate.control.delivery.console import Printer
from wakegate.control.delivery.progress import Meter, Phase, Progress, Tracker


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_rate_and_eta_come_from_the_recent_window() -> None:
    meter = Meter(window=3.0)
    assert meter.update(0.0, 0, 1000) == (None, None)
    rate, eta = meter.update(1.0, 100, 1000)
    assert rate == 100 and eta == 9
    for t in range(2, 10):
        rate, eta = meter.update(float(t), 100 + (t - 1) * 10, 1000)
    assert rate is not None and abs(rate - 10) < 1e-9


def test_events_are_throttled_but_phases_and_the_end_always_reported() -> None:
    seen: list[Progress] = []
    tracker = Tracker(seen.append, Progress(Phase.PULLING, "oci://r/m:v1", total=100), now=0.0, interval=0.5)
    for i in range(1, 11):
        tracker.advance(10, now=i * 0.1)
    tracker.finish(1.1)
    assert [e.done for e in seen] == [0, 50, 100, 100]
    assert seen[-1].phase is Phase.READY


def test_a_terminal_gets_one_live_line_and_a_file_gets_plain_lines() -> None:
    events = [Progress(Phase.PULLING, "oci://r/m:v1", n * 10**8, 4 * 10**8, 5e7, (4 - n) * 2.0) for n in range(4)]
    events.append(Progress(Phase.READY, "oci://r/m:v1", 4 * 10**8, 4 * 10**8, 5e7))
    tty = _Tty()
    printer = Printer("auto", tty)
    for event in events:
        printer(event)
    text = tty.getvalue()
    assert text.count("\r\x1b[2K") == 5 and text.endswith("\n") and text.count("\n") == 1
    assert "100.0 MB / 400.0 MB (25%) 50.0 MB/s ETA 6s" in text
    plain = io.StringIO()
    printer = Printer("auto", plain)
    for event in events:
        printer(event)
    lines = plain.getvalue().splitlines()
    assert "\r" not in plain.getvalue()
    assert lines[0].startswith("pulling oci://r/m:v1 0 B / 400.0 MB (0%)") and lines[-1].startswith("ready")
    assert len(lines) == 2  # throttled to one line per phase within PLAIN_INTERVAL
