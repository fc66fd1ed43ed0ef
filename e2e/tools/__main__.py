"""Build (or reuse) the Go tools in e2e/.bin and print `NAME: PATH` for each.

`python -m e2e.tools [--force] [NAME...]`; no NAME means every tool.
"""

from __future__ import annotations

import sys

from e2e.build import ensure_cli
from e2e.tools import TOOLS, _log, ensure


def main(argv: list[str] | None = None) -> int:
    return ensure_cli("python -m e2e.tools", __doc__ or "", "tool", list(TOOLS), ensure, _log, argv)


if __name__ == "__main__":
    sys.exit(main())
