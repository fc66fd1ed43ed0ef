#!/usr/bin/env bash
# Build KEDA's operator (v2.20.2) from its Go module into e2e/.bin/keda-operator.
#
# KEDA's go.mod pins its Kubernetes libraries with `replace` directives, which only
# apply when KEDA is the main module; so the module is copied out of the module
# cache and built in place rather than required from another go.mod.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
version="${KEDA_VERSION:-v2.20.2}"
src="$(cd /tmp && go mod download -json "github.com/kedacore/keda/v2@${version}" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')"
work="$here/.build/keda-$version"
rm -rf "$work" && mkdir -p "$work" "$here/.bin"
cp -r "$src/." "$work/" && chmod -R u+w "$work"
cd "$work"
# `go build -v` names each package as it compiles; a line every 100 of them shows progress
# (a cold build compiles about 1,600 and takes ~8 min on two cores). Anything else it says
# (errors) passes through; pipefail keeps go's exit status.
echo "building $here/.bin/keda-operator (a line per 100 packages compiled)"
started=$SECONDS
compiled=0
CGO_ENABLED=0 nice -n 10 go build -v -trimpath -o "$here/.bin/keda-operator" ./cmd/operator 2>&1 |
  while IFS= read -r line; do
    if [[ "$line" =~ ^[A-Za-z0-9._~/-]+$ ]]; then
      compiled=$((compiled + 1))
      if (( compiled % 100 == 0 )); then echo "keda: $compiled packages compiled, $((SECONDS - started))s"; fi
    else
      echo "$line"
    fi
  done
echo "built $here/.bin/keda-operator in $((SECONDS - started))s"
