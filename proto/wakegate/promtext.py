"""The one reader of Prometheus' text exposition format, for what wakegate reads from engines.

Pure: text in, samples out. `samples` yields each sample line as (name, labels, value), the
labels as their raw text (`labels` turns it into a dict, only for the samples that need it).
Comments, blank lines and lines that do not parse are skipped, never an error: an engine's
/metrics is read for a few series, and one odd line must not hide them. `names`, when given,
skips every other series before its value is parsed.

Not prometheus_client's `text_string_to_metric_families`: it parses every line into families
and checks the format, ~60 times slower on a vLLM-shaped exposition (~10 ms against ~0.17 ms
for 312 lines, tests/bench/bench_promtext.py), and extproc reads each engine's /metrics twice a
second on the event loop that serves requests (docs/decisions.md, "One Prometheus text reader").
"""

from __future__ import annotations

import re
from collections.abc import Container, Iterator
from typing import NamedTuple

_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class Sample(NamedTuple):
    name: str
    labels: str
    """The text between the braces (`a="1",b="2"`); empty when the sample has none."""
    value: float


def samples(text: str, names: Container[str] | None = None) -> Iterator[Sample]:
    """Every sample in `text` (only those of `names` when given), in order."""
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        if line[0] in " \t":
            line = line.lstrip()
            if not line or line[0] == "#":
                continue
        brace = line.find("{")
        space = line.find(" ")
        if brace >= 0 and (space < 0 or brace < space):
            name = line[:brace]
            if names is not None and name not in names:
                continue
            close = line.rfind("}")
            if close < brace:
                continue
            labels, rest = line[brace + 1 : close], line[close + 1 :]
        elif space > 0:
            name = line[:space]
            if names is not None and name not in names:
                continue
            labels, rest = "", line[space:]
        else:
            continue
        words = rest.split(None, 1)
        if not words:
            continue
        try:
            value = float(words[0])
        except ValueError:
            continue
        yield Sample(name, labels, value)


def labels(text: str) -> dict[str, str]:
    """The labels of a sample (`Sample.labels`) as a dict; escapes are kept as written."""
    return dict(_LABEL.findall(text))
