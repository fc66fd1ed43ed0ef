#!/usr/bin/env bash
# Build one of KEDA's binaries (v2.20.2) from its Go module into e2e/.bin/keda-<what>:
#   e2e/keda/build.sh            # operator  (./cmd/operator) -> e2e/.bin/keda-operator
#   e2e/keda/build.sh adapter    # metrics API server (./cmd/adapter) -> e2e/.bin/keda-adapter
#
# KEDA's go.mod pins its Kubernetes libraries with `replace` directives, which only
# apply when KEDA is the main module; so the module is copied out of the module
# cache and built in place rather than required from another go.mod.
#
# Each binary has its own work dir (e2e/.build/keda-<what>-<version>) and is linked
# there first, then moved into e2e/.bin with one rename: a test running the other
# binary (or an older copy of this one) never sees a half-written file, and two
# binaries can be built one after the other without touching each other.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
what="${1:-operator}"
case "$what" in
  operator|adapter) ;;
  *) echo "usage: $0 [operator|adapter]" >&2; exit 2 ;;
esac
version="${KEDA_VERSION:-v2.20.2}"
src="$(cd /tmp && go mod download -json "github.com/kedacore/keda/v2@${version}" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')"
if [[ "$what" == operator ]]; then
  work="$here/.build/keda-$version"   # the path earlier builds used: its files stay reusable
else
  work="$here/.build/keda-$what-$version"
fi
rm -rf "$work" && mkdir -p "$work" "$here/.bin"
cp -r "$src/." "$work/" && chmod -R u+w "$work"
cd "$work"
# `go build -v` names each package as it compiles; a line every 100 of them shows progress
# (a cold operator build compiles about 1,600 and takes ~8 min on two cores; the adapter
# shares almost all of them, so after the operator it is mostly a relink). Anything else it
# says (errors) passes through; pipefail keeps go's exit status.
echo "building $here/.bin/keda-$what (a line per 100 packages compiled)"
started=$SECONDS
compiled=0
CGO_ENABLED=0 nice -n 10 go build -v -trimpath -o "$work/keda-$what.out" "./cmd/$what" 2>&1 |
  while IFS= read -r line; do
    if [[ "$line" =~ ^[A-Za-z0-9._~/-]+$ ]]; then
      compiled=$((compiled + 1))
      if (( compiled % 100 == 0 )); then echo "keda: $compiled packages compiled, $((SECONDS - started))s"; fi
    else
      echo "$line"
    fi
  done
# Same filesystem (both under e2e/): a rename, atomic for anyone running the old binary.
mv -f "$work/keda-$what.out" "$here/.bin/keda-$what"
echo "built $here/.bin/keda-$what in $((SECONDS - started))s"
