"""docs/architecture.md's layout table names what is in the tree, and nothing that is not."""

from __future__ import annotations

import re
import subprocess

from tests.support import REPO_ROOT

DOC = (REPO_ROOT / "docs" / "architecture.md").read_text()
TABLE = DOC[DOC.index("## Layout") :]
ROWS = [line for line in TABLE.splitlines() if line.startswith("| `")]
PATHS = {path for row in ROWS for path in re.findall(r"`([a-z0-9_]+/[a-z0-9_./-]*)`", row)}
TEXT = "\n".join(ROWS)


def test_every_path_in_the_table_exists() -> None:
    missing = sorted(p for p in PATHS if not (REPO_ROOT / p).exists())
    assert missing == []


def test_every_package_and_module_has_a_row() -> None:
    unnamed = []
    for half in ("control", "extproc"):
        for entry in sorted((REPO_ROOT / half).iterdir()):
            if entry.name.startswith("__") or entry.name == "py.typed":
                continue
            path = f"{half}/{entry.name}" + ("/" if entry.is_dir() else "")
            if not any(p == path.rstrip("/") or p.startswith(path) for p in PATHS) and f"`{entry.name}`" not in TEXT:
                unnamed.append(path)
    assert unnamed == []


def test_every_process_main_is_named() -> None:
    mains = sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "control").glob("*/main.py"))
    assert mains and all(main in PATHS for main in [*mains, "extproc/main.py", "proto/wakegate/cli.py"])


def test_the_table_is_one_table_with_one_row_per_path() -> None:
    lines = TABLE.splitlines()
    body = lines[lines.index(ROWS[0]) : lines.index(ROWS[-1]) + 1]
    assert all(line.startswith("| ") for line in body), "a blank or stray line splits the table"
    firsts = [row.split("|")[1].strip() for row in ROWS]
    assert sorted(f for f in firsts if firsts.count(f) > 1) == []


#: One concept per room: no hand-written Python file grows past this (generated protobuf modules
#: excepted; issue 32).
MAX_LINES = 700


def test_no_hand_written_module_is_past_the_line_budget() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    long = {
        path: lines
        for path in tracked
        if "_pb2" not in path and (lines := len((REPO_ROOT / path).read_text().splitlines())) > MAX_LINES
    }
    assert long == {}
