"""`python -m e2e.helm [--force]`: build (or reuse) e2e/.bin/helm."""

from __future__ import annotations

import sys

from e2e.build import build_cli
from e2e.helm import HELM, STAMP, _log, ensure_helm, is_current

if __name__ == "__main__":
    sys.exit(build_cli(sys.argv[1:], "python -m e2e.helm", __doc__.splitlines()[0], HELM, STAMP, is_current,
                       ensure_helm, _log))
