"""`python -m e2e.helm [--force]`: build (or reuse) e2e/.bin/helm; the same as `python -m e2e.tools helm`."""

from __future__ import annotations

import sys

from e2e.tools.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["helm", *sys.argv[1:]]))
