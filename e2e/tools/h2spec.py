"""h2spec, the HTTP/2 conformance checker, run against a server and read back case by case.

    report = run_h2spec("127.0.0.1", port)          # plain h2c with prior knowledge
    assert not report.failed(), report.summary()

Cases are named the way h2spec's own command line names them ("http2/6.5.3/2":
section 6.5.3, second case), so a failing id can be rerun by hand with
`e2e/.bin/h2spec -p PORT http2/6.5.3/2`. Results come from h2spec's JUnit report,
where a case's number is its position in its group; that holds only when whole
groups run, so `sections` takes groups ("http2/6.5", "hpack"), not single cases.
"""

from __future__ import annotations

import html
import re
import subprocess
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from e2e import tools

Outcome = Literal["passed", "failed", "skipped"]

#: a spec ("http2") or a group in it ("http2/6.5", "http2/6.5.3")
_SECTION = re.compile(r"[a-z0-9]+(/[0-9]+(\.[0-9]+)*)?")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_PROBLEM = re.compile(r"(<(failure|error)>)(.*?)(</\2>)", re.DOTALL)


class H2specError(RuntimeError):
    pass


@dataclass(frozen=True)
class Case:
    #: h2spec's id, e.g. "http2/6.5.3/2"
    id: str
    description: str
    outcome: Outcome
    #: what h2spec expected and what it saw, for a failed case
    detail: str


@dataclass(frozen=True)
class Report:
    cases: tuple[Case, ...]
    #: h2spec's own output, colours removed
    output: str

    def failed(self) -> list[Case]:
        return [c for c in self.cases if c.outcome == "failed"]

    def outcome(self, case_id: str) -> Outcome:
        for case in self.cases:
            if case.id == case_id:
                return case.outcome
        raise KeyError(case_id)

    def summary(self) -> str:
        """One line of counts, then one line per failed case."""
        counts = {o: sum(c.outcome == o for c in self.cases) for o in ("passed", "failed", "skipped")}
        lines = [f"{len(self.cases)} cases: {counts['passed']} passed, {counts['failed']} failed, "
                 f"{counts['skipped']} skipped"]
        lines += [f"  {c.id} {c.description}: {' '.join(c.detail.split())}" for c in self.failed()]
        return "\n".join(lines)


def run_h2spec(
    host: str, port: int, sections: tuple[str, ...] = (), case_timeout: int = 2, tls: bool = False,
    run_timeout: float = 600.0,
) -> Report:
    """Run h2spec (built on first use) against HOST:PORT; plain h2c unless `tls` (certificate not checked).

    A server that fails cases is a Report, not an error; H2specError means h2spec itself
    could not run (e.g. nothing listens on the port)."""
    for section in sections:
        if not _SECTION.fullmatch(section):
            raise ValueError(f"{section!r} is not an h2spec group (like 'http2/6.5')")
    # A group runs its subgroups too; naming a subgroup as well would make h2spec run only
    # that subgroup of the parent (its section filter overwrites the parent's entry).
    sections = tuple(s for s in sections if not any(is_subgroup(s, other) for other in sections))
    with tempfile.TemporaryDirectory(prefix="h2spec-") as tmp:
        junit = Path(tmp) / "report.xml"
        argv = [str(tools.ensure("h2spec")), "-h", host, "-p", str(port), "-o", str(case_timeout),
                "-j", str(junit), *(["-t", "-k"] if tls else []), *sections]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=run_timeout)
        output = _ANSI.sub("", proc.stdout + proc.stderr).replace("\r", "")
        if not junit.exists():
            raise H2specError(f"h2spec exited {proc.returncode} without a report:\n{output[-2000:]}")
        return Report(parse_junit(junit.read_text()), output)


def is_subgroup(section: str, group: str) -> bool:
    """`section` is a strict subgroup of `group` ("http2/6.5.3" of "http2/6.5" or of "http2")."""
    return section.startswith(group + ("." if "/" in group else "/"))


def parse_junit(xml: str) -> tuple[Case, ...]:
    # h2spec puts a failure's text into the XML unescaped; escape it so any "<" in it parses.
    xml = _PROBLEM.sub(lambda m: m[1] + html.escape(html.unescape(m[3]), quote=False) + m[4], xml)
    cases: list[Case] = []
    for suite in ET.fromstring(xml).iter("testsuite"):
        group = suite.get("package", "")
        for seq, case in enumerate(suite.iter("testcase"), start=1):
            outcome: Outcome = "passed"
            detail = ""
            # h2spec writes its failures as <error> (a type switch in its reporter misses them).
            problem = case.find("failure")
            if problem is None:
                problem = case.find("error")
            if problem is not None:
                outcome, detail = "failed", _explain(problem.text or "")
            elif case.find("skipped") is not None:
                outcome = "skipped"
            cases.append(Case(f"{group}/{seq}", case.get("classname", ""), outcome, detail))
    return tuple(cases)


def _explain(text: str) -> str:
    """h2spec's failure text is the expected outcomes, one a line, then what it saw."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if len(lines) < 2:
        return " ".join(lines)
    return f"expected {' or '.join(lines[:-1])}; got {lines[-1]}"
