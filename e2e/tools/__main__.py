"""Build (or reuse) the Go tools in e2e/.bin and print `NAME: PATH` for each.

`python -m e2e.tools [--force] [NAME...]`; no NAME means every tool.
"""

from __future__ import annotations

import argparse
import sys

from e2e.tools import TOOLS, BuildError, _log, ensure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.tools", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"one of {', '.join(TOOLS)} (default: all)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the stamp matches")
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in TOOLS]
    if unknown:
        parser.error(f"unknown tool {', '.join(unknown)} (known: {', '.join(TOOLS)})")
    for name in args.names or TOOLS:
        try:
            binary = ensure(name, force=args.force)
        except BuildError as exc:
            _log(f"building {name} failed:\n{exc}")
            return 1
        print(f"{name}: {binary}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
