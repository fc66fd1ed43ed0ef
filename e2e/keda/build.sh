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
CGO_ENABLED=0 nice -n 10 go build -trimpath -o "$here/.bin/keda-operator" ./cmd/operator
echo "built $here/.bin/keda-operator"
