"""`python -m e2e.helm [--force]`: build (or reuse) e2e/.bin/helm."""

from __future__ import annotations

import argparse
import sys

from e2e.helm import HELM, STAMP, BuildError, _log, ensure_helm, is_current


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.helm", description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if the stamp matches")
    args = parser.parse_args(argv)
    if not args.force and is_current():
        _log(f"up to date: {HELM} (delete {STAMP} or pass --force to rebuild)")
        return 0
    try:
        ensure_helm(force=True)
    except BuildError as exc:
        _log(f"build failed:\n{exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
