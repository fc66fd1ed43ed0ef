"""`wakegate savings`: what idling saved, per model, over a time window, as a table.

    wakegate savings [--admin 127.0.0.1:8081] [--window 1h | --since T --until T] [--json]

It asks a running `wakegate up` (its admin address, `--admin-listen`) for `/savings`: per model,
accelerator-seconds warm (held), asleep and at zero (released), the share released, and the wakes
from each tier with the waiting they cost (their count and summed seconds). The numbers are the
ones `/metrics` counts (`wakegate_accelerator_seconds_total`, `wakegate_wake_seconds`), cut at the
window's ends. Errors are one line on stderr and status 1.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from wakegate.control.scaling.savings import TIERS, WAKE_TIERS
from wakegate.process import add_log_level, setup_logging

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw]?)$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def duration(text: str) -> float:
    """argparse type: `90`, `90s`, `15m`, `2h`, `7d`, `1w` -> seconds."""
    found = _DURATION.match(text.strip())
    if found is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 90s, 15m, 2h, 7d")
    return float(found.group(1)) * _UNITS[found.group(2)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--admin", default="127.0.0.1:8081", metavar="HOST:PORT",
                        help="the admin address of `wakegate up` (its --admin-listen)")
    parser.add_argument("--window", type=duration, default=None,
                        help="the last DURATION (90s, 15m, 2h, 7d); default: since up started")
    parser.add_argument("--since", type=float, default=None, metavar="EPOCH", help="window start, epoch seconds")
    parser.add_argument("--until", type=float, default=None, metavar="EPOCH", help="window end, epoch seconds")
    parser.add_argument("--json", action="store_true", help="the answer as JSON instead of a table")
    add_log_level(parser)


def fetch(admin: str, since: float | None, until: float | None) -> dict[str, Any]:
    query = {k: repr(v) for k, v in (("since", since), ("until", until)) if v is not None}
    url = f"http://{admin}/savings" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    with urllib.request.urlopen(url, timeout=10) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def table(answer: dict[str, Any]) -> str:
    """The fixed-width table `wakegate savings` prints (accelerator-seconds with one decimal)."""
    head = ["MODEL", *(t.upper() for t in TIERS), "RELEASED", "WAKES ASLEEP", "WAIT ASLEEP", "WAKES ZERO",
            "WAIT ZERO"]
    rows = [head]
    for model, row in sorted(answer["models"].items()):
        seconds = row["accelerator_seconds"]
        wakes = row["wakes"]
        rows.append([
            model,
            *(f"{seconds[t]:.1f}" for t in TIERS),
            f"{row['released_share'] * 100:.0f}%",
            *(cell for t in WAKE_TIERS for cell in (str(wakes[t]["count"]), f"{wakes[t]['wait_seconds']:.2f}s")),
        ])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    span = answer["until"] - answer["since"]
    window = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(answer["since"]))
    return "\n".join([f"accelerator-seconds over {span:.0f}s from {window} (warm held; asleep, zero released)",
                      *lines])


def main(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    until = args.until
    since = args.since
    if args.window is not None:
        until = until if until is not None else time.time()
        since = until - args.window
    try:
        answer = fetch(args.admin, since, until)
    except urllib.error.HTTPError as exc:
        print(f"wakegate savings: {args.admin}: HTTP {exc.code} {exc.read()[:200].decode(errors='replace')}",
              file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"wakegate savings: cannot read {args.admin}/savings: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(answer, indent=2) if args.json else table(answer))
    return 0
