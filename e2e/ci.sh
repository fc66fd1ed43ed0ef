#!/usr/bin/env bash
# Build (or reuse) the pinned control-plane binaries, then run the e2e suite.
# Called from .ci/run; extra arguments go to pytest (e.g. -k endpointslice).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${VIRTUAL_ENV:-}" && -f .venv/bin/activate ]]; then
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
if ! command -v ip >/dev/null; then
  # Pod networking (network namespaces, veths, routes: e2e/net.py) runs `ip` from iproute2.
  apt-get install -y iproute2 || { apt-get update && apt-get install -y iproute2; }
fi
start=$(date +%s)
python -m e2e.build
# KEDA's operator, for the external-push e2e (about 15 min of CPU cold; a relink with a warm
# Go build cache).
if [[ ! -x e2e/.bin/keda-operator ]]; then
  echo "e2e: building KEDA's operator from its Go module"
  e2e/keda/build.sh
fi
# KEDA's metrics API server (external.metrics.k8s.io, for the HPA e2e): the same module, so after
# the operator most packages are in Go's build cache (~1.5 min; ~17 min alone with an empty cache
# on a crowded machine).
if [[ ! -x e2e/.bin/keda-adapter ]]; then
  echo "e2e: building KEDA's metrics adapter from its Go module"
  e2e/keda/build.sh adapter
fi
# The real node (e2e/test_real_node.py; WAKEGATE_E2E_REAL_NODE=0 leaves it out): its kubelet
# (~100 packages beyond the control plane's, so a short build after them) and the pause image.
if [[ "${WAKEGATE_E2E_REAL_NODE:-1}" != 0 ]]; then
  python -m e2e.node build
fi
echo "e2e: binaries ready after $(( $(date +%s) - start ))s"
python -m pytest e2e -q --durations=25 "$@"
echo "e2e: done in $(( $(date +%s) - start ))s"
