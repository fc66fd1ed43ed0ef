#!/usr/bin/env python3
"""Regenerate the Grafana dashboards and Prometheus alerts shipped in charts/wakegate.

    python scripts/gen_dashboards.py          # write charts/wakegate/dashboards/*.json, files/alerts.yaml
    python scripts/gen_dashboards.py --check  # exit 1 if a committed file is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dashboards.build import REPO, stale, write


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when stale")
    args = parser.parse_args()
    paths = stale() if args.check else write()
    for path in paths:
        print(f"{'stale' if args.check else 'wrote'}: {path.relative_to(REPO)}")
    return 1 if args.check and paths else 0


if __name__ == "__main__":
    sys.exit(main())
